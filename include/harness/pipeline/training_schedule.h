// Pipeline training schedules as plain data: each device's ordered forward and backward actions for
// GPipe, 1F1B, interleaved 1F1B and the zero-bubble schedules ZB-H1 and ZB-V (Qi et al., ICLR
// 2024), one validator, and a simulator with its Gantt chart. Nothing here knows about tensors or
// devices; an executor applies the lists, tests read them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace harness::pipeline {

// One unit of work on one device: the forward or backward of micro-batch `micro_batch` through
// model chunk `stage`. With D devices and V chunks per device there are S = D * V stages (virtual
// stages), numbered in model order; which device holds which is the schedule's placement (below).
// A zero-bubble schedule splits the backward in two (TrainingSchedule::split_backward): kBackward
// is then B, the gradient of the stage's input alone, which the previous stage waits for, and
// kWeight is W, the stage's deferred weight-gradient products, which nobody waits for.
struct Action {
  enum class Kind { kForward, kBackward, kWeight };
  Kind kind = Kind::kForward;
  int micro_batch = 0;
  int stage = 0;

  static Action forward(int micro_batch, int stage) { return {Kind::kForward, micro_batch, stage}; }
  static Action backward(int micro_batch, int stage) {
    return {Kind::kBackward, micro_batch, stage};
  }
  static Action weight(int micro_batch, int stage) { return {Kind::kWeight, micro_batch, stage}; }
};

bool operator==(const Action& a, const Action& b);
bool operator!=(const Action& a, const Action& b);

// The device that runs `stage` under the loop placement (stage % devices), and the stage's chunk
// index on that device (stage / devices).
int device_of_stage(int stage, int devices);
int chunk_of_stage(int stage, int devices);

// Which device holds which stage.
//   kLoop: device d holds stages d, d + D, d + 2D, ... (Megatron's interleaving; V = 1: stage d).
//   kV:    V = 2, device d holds stages d and 2D - 1 - d, so the model goes down the devices and
//          back up (ZB-V): device 0 holds the first and the last stage, device D - 1 the two in
//          the middle, which hand over in memory.
enum class StagePlacement { kLoop, kV };
// The device of `stage` among `devices` under `placement`, and the stage's index among that
// device's chunks, in model order.
int device_of_stage(int stage, int devices, StagePlacement placement);
int chunk_of_stage(int stage, int devices, StagePlacement placement);

// Every device's actions for one training step, in the order the device runs them. A device runs
// its next action once the actions it depends on have finished anywhere in the pipeline:
//   forward  (i, s) needs forward (i, s - 1)                     (nothing for s = 0)
//   backward (i, s) needs forward (i, s) and backward (i, s + 1)  (only the forward for s = S - 1)
//   weight   (i, s) needs backward (i, s)                         (split_backward only)
struct TrainingSchedule {
  std::string name;                             // "gpipe", "1f1b", "interleaved", "zb1p" or "zbv"
  int devices = 0;                              // D
  int virtual_stages = 1;                       // V, model chunks per device
  int micro_batches = 0;                        // M
  StagePlacement placement = StagePlacement::kLoop;
  // Whether every backward is listed as B and W (kBackward and kWeight); otherwise each kBackward
  // is the whole backward and no kWeight appears.
  bool split_backward = false;
  std::vector<std::vector<Action>> per_device;  // [device] -> ordered actions
  // The schedule's stated bound on activations a device holds at once: (micro-batch, chunk) pairs
  // whose forward it has run and whose backward (with split_backward: whose W) it has not, over
  // all its chunks. For V = 1 that is micro-batches in flight. validate_schedule checks every
  // device against it.
  int in_flight_bound = 0;

  int stages() const { return devices * virtual_stages; }
  int device_of(int stage) const;  // by the placement
  int chunk_of(int stage) const;   // the stage's index among its device's chunks, in model order
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

// How long each kind of action takes, in ticks, for simulate() and for
// zbv_schedule's clock: a whole backward (a schedule
// without split_backward) takes input_gradient + weight_gradient. The paper's unit comparison is
// {1, 1, 1}: F, B and W alike, so a whole backward is twice a forward.
struct ActionTicks {
  int forward = 1;
  int input_gradient = 1;   // B
  int weight_gradient = 1;  // W
};

// ZB-H1 (Qi et al., ICLR 2024, "zb1p"): 1F1B's order of forwards and B passes, each device's W
// passes delayed into its cool-down bubble. Device d runs W of micro-batch k - d right after B of
// micro-batch k, and its last min(d, M) W passes after its last B. The last devices, idle at the
// end of 1F1B while the gradients travel back, fill that time with W passes; the B passes that
// travel back are shorter than a whole backward. For M = 4, D = 2:
//   device 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3
//   device 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3
// Device d holds at most (D - d - 1) + 1 forwards awaiting B plus d awaiting W, so
// in_flight_bound = min(D, M), 1F1B's. With F, B and W one unit each the bubble is
// (D - 1) / (3 M + D - 1) against 1F1B's 3 (D - 1) / (3 M + 3 (D - 1)): about a third.
// Same argument checks as gpipe_schedule.
TrainingSchedule zb1p_schedule(int micro_batches, int devices);

// ZB-V (Qi et al., "zbv"): two chunks per device in V placement (StagePlacement::kV, S = 2 D
// stages of half a device's layers each), ordered by a greedy list scheduler on a clock where each
// action takes its stage's ticks (stage_ticks[s]; F, B and W one tick each when none are given,
// the paper's clock): whenever a device is free it starts, in this order of preference, a B whose
// gradient has arrived (its earlier chunk first, whose gradient the previous device waits for); a
// forward whose input has arrived (its later chunk first, nearer the loss), if the device then
// holds at most 2 D chunk activations (1F1B's memory: D whole stages) and, for its earlier chunk,
// still has room for the later chunk of a micro-batch it started (else nothing could free a
// place); otherwise its oldest waiting W. A device with nothing to start waits for the next action
// to finish anywhere. Deterministic: the same lists for the same M, D and ticks.
// With F, B and W one tick a chunk, for D <= 8 and D <= M <= 16 its bubble is at most 0.39 of
// 1F1B's and at most ZB-H1's (M = 4, D = 2: 0.04 against 0.2), what is left being the first
// micro-batch's trip down and the last one's back up. Stages of unequal cost (GPT-2's head on the
// last, the embedding on the first) shift that order: given their ticks, the W passes go where the
// other device would otherwise be waited for (estimate_gpt2_stage_ticks gives GPT-2's).
// in_flight_bound = min(2 D, 2 M) chunk activations, the constraint above.
// Same argument checks as gpipe_schedule; stage_ticks, when given, needs 2 D entries of at least
// one tick each (std::invalid_argument otherwise).
TrainingSchedule zbv_schedule(int micro_batches, int devices, const std::vector<ActionTicks>& stage_ticks = {});

// --pipeline_schedule: GPipe's order (every forward, then every backward), 1F1B's, Megatron's
// interleaved 1F1B over V virtual stages a device, ZB-H1 or ZB-V.
enum class ScheduleKind { kGpipe, kOneFOneB, kInterleaved, kZb1p, kZbv };
// "gpipe" | "1f1b" | "interleaved" | "zb1p" | "zbv"; anything else throws std::invalid_argument
// naming the flag:
//   "--pipeline_schedule must be gpipe, 1f1b, interleaved, zb1p or zbv, got 'zigzag'"
ScheduleKind parse_schedule_kind(const std::string& text);
// The flag's value: "gpipe", "1f1b", "interleaved", "zb1p" or "zbv".
std::string to_string(ScheduleKind kind);
// Whether the schedule runs the backward as B and W (zb1p, zbv): the step then defers the linear
// layers' weight gradients.
bool splits_backward(ScheduleKind kind);
// Chunks a device holds under `kind` given --virtual_stages: 2 for zbv (its V), else the flag.
int chunks_per_device(ScheduleKind kind, int virtual_stages);
// kV for zbv, else kLoop.
StagePlacement placement_of(ScheduleKind kind);

// The schedule flags both programs take, checked once: --virtual_stages V >= 1, V > 1 only when
// interleaved, and zbv with V = 1 (the default) or 2 (its own two chunks). Throws
// std::invalid_argument naming the flag and the value:
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
// (with split_backward: every F, B and W) of every (micro-batch, stage) appears exactly once, on
// the device that owns the stage, and no W without split_backward; running each list in order,
// with the dependencies above, never deadlocks; and no device ever holds more than
// in_flight_bound activations.
void validate_schedule(const TrainingSchedule& schedule);

// A schedule run on a clock: a device starts its next action in the first tick after everything
// it depends on has finished, and the action holds the device for its ticks. Messages between
// devices are free.
struct Timeline {
  int devices = 0;                                        // for labels
  int virtual_stages = 1;                                 // for labels: chunk suffix when V > 1
  StagePlacement placement = StagePlacement::kLoop;       // for labels
  std::vector<std::vector<std::optional<Action>>> slots;  // [device][tick], nullopt = idle
  int ticks = 0;
  double bubble = 0.0;              // idle slots / all slots
  std::vector<int> peak_in_flight;  // per device, most activations held at once

  int64_t total_slots() const;  // devices * ticks
  int64_t idle_slots() const;
};

// Every action, of whatever kind, one tick. Bubbles in these units: GPipe and 1F1B both
// (D - 1) / (M + D - 1); an interleaved step is a chunk, 1/V of a device's work, so its ticks are
// V times shorter and its bubble comes out near (D - 1) / (V M + D - 1). Validates first
// (validate_schedule), so a schedule that would deadlock throws instead.
Timeline simulate_unit_time(const TrainingSchedule& schedule);

// The same with each kind's ticks: with {1, 1, 1}, 1F1B's bubble is (D - 1) / (M + D - 1) still
// and ZB-H1's (D - 1) / (3 M + D - 1). A zbv chunk is half a device's layers: give it half the
// ticks of a one-chunk schedule's action to compare them.
Timeline simulate(const TrainingSchedule& schedule, const ActionTicks& ticks);

// The same with each stage's own ticks (stage_ticks[s] for stage s, one entry per stage).
Timeline simulate(const TrainingSchedule& schedule, const std::vector<ActionTicks>& stage_ticks);

// "F3" / "B3" / "W3" for micro-batch 3; with V > 1 the chunk on its device follows, "F3.1".
std::string action_label(const Action& action, int devices, int virtual_stages,
                         StagePlacement placement = StagePlacement::kLoop);
std::string action_label(const Action& action, const TrainingSchedule& schedule);

// One line per device, its actions in order: "device 0: F0 F1 B0 F2 B1 F3 B2 B3".
std::string format_actions(const TrainingSchedule& schedule);

// The timeline as a Gantt chart in gantt_chart's layout, one row per device, "." idle; an action
// of several ticks fills each of them. GPipe with M = 3, D = 2:
//   clock     0  1  2  3  4  5  6  7
//   device 0  F0 F1 F2 .  .  B2 B1 B0
//   device 1  .  F0 F1 F2 B2 B1 B0 .
std::string format_timeline(const Timeline& timeline);

}  // namespace harness::pipeline
