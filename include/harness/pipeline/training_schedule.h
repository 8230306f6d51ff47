// Pipeline training schedules as plain data: each device's ordered forward and backward actions for
// GPipe, 1F1B and interleaved 1F1B, one validator, and a unit-time simulator with its Gantt chart.
// Nothing here knows about tensors or devices; an executor applies the lists, tests read them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace harness::pipeline {

// One unit of work on one device: the forward or backward of micro-batch `micro_batch` through
// model chunk `stage`. With D devices and V chunks per device there are S = D * V stages (virtual
// stages), numbered in model order; device d holds chunks d, d + D, d + 2D, ... (Megatron's
// assignment), so the owner is stage % D and, for V = 1, stage j runs on device j.
struct Action {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  int micro_batch = 0;
  int stage = 0;

  static Action forward(int micro_batch, int stage) { return {Kind::kForward, micro_batch, stage}; }
  static Action backward(int micro_batch, int stage) {
    return {Kind::kBackward, micro_batch, stage};
  }
};

bool operator==(const Action& a, const Action& b);
bool operator!=(const Action& a, const Action& b);

// The device that runs `stage` (stage % devices), and the stage's chunk index on that device
// (stage / devices).
int device_of_stage(int stage, int devices);
int chunk_of_stage(int stage, int devices);

// Every device's actions for one training step, in the order the device runs them. A device runs
// its next action once the actions it depends on have finished anywhere in the pipeline:
//   forward  (i, s) needs forward (i, s - 1)                     (nothing for s = 0)
//   backward (i, s) needs forward (i, s) and backward (i, s + 1)  (only the forward for s = S - 1)
struct TrainingSchedule {
  std::string name;                             // "gpipe", "1f1b" or "interleaved"
  int devices = 0;                              // D
  int virtual_stages = 1;                       // V, model chunks per device
  int micro_batches = 0;                        // M
  std::vector<std::vector<Action>> per_device;  // [device] -> ordered actions
  // The schedule's stated bound on activations a device holds at once: (micro-batch, chunk) pairs
  // whose forward it has run and whose backward it has not, over all its chunks. For V = 1 that is
  // micro-batches in flight. validate_schedule checks every device against it.
  int in_flight_bound = 0;

  int stages() const { return devices * virtual_stages; }
};

// GPipe (Huang et al. 2019): every device runs all M forwards in order, then all M backwards in
// reverse order, the per-device view of clock_cycles / backward_clock_cycles. For M = 3, D = 2:
//   device 0: F0 F1 F2 B2 B1 B0
//   device 1: F0 F1 F2 B2 B1 B0
// in_flight_bound = M: every micro-batch's activations are held until the backward starts.
// Throws std::invalid_argument unless micro_batches >= 1 and devices >= 1.
TrainingSchedule gpipe_schedule(int micro_batches, int devices);

// GPipe over D * V stages placed round-robin (stage c * D + d on device d): each device runs every
// micro-batch's forward through its chunks in model order, then every backward in reverse. For
// M = 2, D = 2, V = 2:
//   device 0: F0.0 F1.0 F0.1 F1.1 B1.1 B0.1 B1.0 B0.0
//   device 1: F0.0 F1.0 F0.1 F1.1 B1.1 B0.1 B1.0 B0.0
// in_flight_bound = M V. The executor's fallback when interleaving cannot take a batch (M % D != 0).
TrainingSchedule gpipe_schedule(int micro_batches, int devices, int virtual_stages);

// 1F1B, PipeDream-Flush (Narayanan et al. 2021) as Megatron-LM's
// forward_backward_pipelining_without_interleaving runs it: device d does w = min(D - d - 1, M)
// warm-up forwards, then M - w pairs of one forward and one backward, then w cool-down backwards.
// For M = 4, D = 2:
//   device 0: F0 F1 B0 F2 B1 F3 B2 B3
//   device 1: F0 B0 F1 B1 F2 B2 F3 B3
// Device d peaks at min(w + 1, M) = min(D - d, M) micro-batches in flight (each pair's forward
// comes before its backward), so in_flight_bound = min(D, M), against GPipe's M.
// Same argument checks as gpipe_schedule.
TrainingSchedule one_f_one_b_schedule(int micro_batches, int devices);

// Interleaved 1F1B (Narayanan et al. SC'21) as Megatron-LM's
// forward_backward_pipelining_with_interleaving (core v0.7) orders it. Each device runs M * V
// chunk-steps; step k is micro-batch (k / (D V)) * D + k % D on chunk (k % (D V)) / D for a
// forward, chunk V - 1 - (k % (D V)) / D for a backward: micro-batches go through the chunks in
// groups of D. Device d does w_d = min(2 (D - d - 1) + (V - 1) D, M V) warm-up forwards (all M V
// when M == D), then forward step w_d + k followed by backward step k, then the remaining
// backwards. For M = 4, D = 2, V = 2 ("F<i>.<chunk>"; chunk c of device d is stage c * D + d):
//   device 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0
//   device 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0
// in_flight_bound = min(M V, (V + 1) D - 1), counted in (micro-batch, chunk) activations: device d
// holds w_d after warm-up and w_d + 1 after each steady-state forward (its backward follows at
// once), and w_d is largest on device 0, 2 (D - 1) + (V - 1) D = (V + 1) D - 2; when warm-up covers
// every step (M == D) it holds all M V. A chunk is 1/V of a device's layers, so device 0 stores
// about D + (D - 1) / V stages' worth of activations against 1F1B's D: interleaving's cost. V = 1
// is accepted and gives Megatron's interleaved order with one chunk (a deeper warm-up than
// one_f_one_b_schedule). Throws std::invalid_argument unless M, D, V >= 1 and M % D == 0, which
// Megatron requires too.
TrainingSchedule interleaved_schedule(int micro_batches, int devices, int virtual_stages);

// --pipeline_schedule: GPipe's order (every forward, then every backward), 1F1B's, or Megatron's
// interleaved 1F1B over V virtual stages a device.
enum class ScheduleKind { kGpipe, kOneFOneB, kInterleaved };
// "gpipe" | "1f1b" | "interleaved"; anything else throws std::invalid_argument naming the flag:
//   "--pipeline_schedule must be gpipe, 1f1b or interleaved, got 'zigzag'"
ScheduleKind parse_schedule_kind(const std::string& text);
// The flag's value: "gpipe", "1f1b" or "interleaved".
std::string to_string(ScheduleKind kind);

// The schedule flags both programs take, checked once: --virtual_stages V >= 1 and V > 1 only when
// interleaved. Throws std::invalid_argument naming the flag and the value:
//   "--virtual_stages 2 needs --pipeline_schedule interleaved (got 1f1b); gpipe and 1f1b run one
//    stage per device"
void check_schedule_kind(ScheduleKind kind, int virtual_stages);
// The same, and for a full batch of M = --n_chunk micro-batches on D devices: M >= 1, and
// interleaving's M % D == 0 (Megatron's rule; a short last batch falls back to GPipe's order):
//   "--pipeline_schedule interleaved needs --n_chunk to be a multiple of the 2 devices (Megatron's
//    rule), got 3"
void check_schedule_flags(ScheduleKind kind, int micro_batches, int devices, int virtual_stages);

// Throws std::invalid_argument, naming the schedule, the device, the action's position in its list
// and the reason, unless: D, V, M >= 1 and there is one list per device; every forward and backward
// of every (micro-batch, stage) appears exactly once, on the device that owns the stage; running
// each list in order, with the dependencies above, never deadlocks; and no device ever holds more
// than in_flight_bound activations.
void validate_schedule(const TrainingSchedule& schedule);

// A schedule run with unit time: every action, forward or backward, takes one tick, and a device
// starts its next action in the first tick after everything it depends on has finished. Messages
// between devices are free. Bubbles in these units: GPipe and 1F1B both (D - 1) / (M + D - 1); an
// interleaved step is a chunk, 1/V of a device's work, so its ticks are V times shorter and its
// bubble comes out near (D - 1) / (V M + D - 1).
struct Timeline {
  int virtual_stages = 1;                                 // for labels: chunk suffix when V > 1
  std::vector<std::vector<std::optional<Action>>> slots;  // [device][tick], nullopt = idle
  int ticks = 0;
  double bubble = 0.0;              // idle slots / all slots
  std::vector<int> peak_in_flight;  // per device, most activations held at once

  int64_t total_slots() const;  // devices * ticks
  int64_t idle_slots() const;
};

// Validates first (validate_schedule), so a schedule that would deadlock throws instead.
Timeline simulate_unit_time(const TrainingSchedule& schedule);

// "F3" / "B3" for micro-batch 3; with V > 1 the chunk on its device follows, "F3.1".
std::string action_label(const Action& action, int devices, int virtual_stages);

// One line per device, its actions in order: "device 0: F0 F1 B0 F2 B1 F3 B2 B3".
std::string format_actions(const TrainingSchedule& schedule);

// The timeline as a Gantt chart in gantt_chart's layout, one row per device, "." idle. GPipe with
// M = 3, D = 2:
//   clock     0  1  2  3  4  5  6  7
//   device 0  F0 F1 F2 .  .  B2 B1 B0
//   device 1  .  F0 F1 F2 B2 B1 B0 .
std::string format_timeline(const Timeline& timeline);

}  // namespace harness::pipeline
