// GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V as per-device action lists; their validator,
// simulator and Gantt chart.
#include "harness/pipeline/training_schedule.h"

#include "harness/pipeline/schedule.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

namespace harness::pipeline {
namespace {

void check_counts(const char* function, int micro_batches, int devices, int virtual_stages) {
  if (micro_batches < 1 || devices < 1 || virtual_stages < 1) {
    throw std::invalid_argument(std::string(function) +
                                ": need at least one micro-batch, device and virtual stage, got "
                                "micro_batches=" +
                                std::to_string(micro_batches) +
                                ", devices=" + std::to_string(devices) +
                                ", virtual_stages=" + std::to_string(virtual_stages));
  }
}

// Throws std::invalid_argument, naming `function`, unless there is one entry per stage and every
// action takes a tick at least.
void check_stage_ticks(const char* function, const std::vector<ActionTicks>& stage_ticks, int stages) {
  if (stage_ticks.size() != static_cast<size_t>(stages)) {
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(stage_ticks.size()) +
                                " stages' ticks given for " + std::to_string(stages) + " stages");
  }
  for (size_t s = 0; s < stage_ticks.size(); ++s) {
    const ActionTicks& t = stage_ticks[s];
    if (t.forward < 1 || t.input_gradient < 1 || t.weight_gradient < 1) {
      throw std::invalid_argument(std::string(function) + ": stage " + std::to_string(s) +
                                  " takes F " + std::to_string(t.forward) + ", B " + std::to_string(t.input_gradient) +
                                  ", W " + std::to_string(t.weight_gradient) + " ticks; each needs at least one");
    }
  }
}

// How long `action` holds its device: a whole backward (`split` false) is B and W together.
int stage_ticks_of(const ActionTicks& ticks, const Action& action, bool split) {
  switch (action.kind) {
    case Action::Kind::kForward: return ticks.forward;
    case Action::Kind::kBackward: return split ? ticks.input_gradient : ticks.input_gradient + ticks.weight_gradient;
    case Action::Kind::kWeight: return ticks.weight_gradient;
  }
  return 1;
}

TrainingSchedule empty_schedule(std::string name, int micro_batches, int devices,
                                int virtual_stages) {
  TrainingSchedule schedule;
  schedule.name = std::move(name);
  schedule.devices = devices;
  schedule.virtual_stages = virtual_stages;
  schedule.micro_batches = micro_batches;
  schedule.per_device.resize(static_cast<size_t>(devices));
  return schedule;
}

const char* kind_word(const Action& action, bool split) {
  switch (action.kind) {
    case Action::Kind::kForward: return "forward";
    case Action::Kind::kBackward: return split ? "input-gradient backward (B)" : "backward";
    case Action::Kind::kWeight: return "weight-gradient pass (W)";
  }
  return "?";
}

std::string describe(const Action& action, bool split = false) {
  return std::string(kind_word(action, split)) + " of micro-batch " + std::to_string(action.micro_batch) +
         " on stage " + std::to_string(action.stage);
}

std::string context(const TrainingSchedule& schedule) {
  return "validate_schedule(" + schedule.name + ", M=" + std::to_string(schedule.micro_batches) +
         ", D=" + std::to_string(schedule.devices) +
         ", V=" + std::to_string(schedule.virtual_stages) + ")";
}

std::string at(const TrainingSchedule& schedule, size_t device, size_t index) {
  return context(schedule) + ": device " + std::to_string(device) + ", action " +
         std::to_string(index) + " (" + describe(schedule.per_device[device][index], schedule.split_backward) + ")";
}

// Per (kind, micro-batch, stage) value, e.g. the tick an action finished or where it was listed.
class ActionMap {
 public:
  ActionMap(int micro_batches, int stages, int initial)
      : per_kind_(static_cast<size_t>(micro_batches) * stages), stages_(stages), values_(3 * per_kind_, initial) {}

  int& operator[](const Action& action) {
    return values_[static_cast<size_t>(action.kind) * per_kind_ + static_cast<size_t>(action.micro_batch) * stages_ +
                   action.stage];
  }

 private:
  size_t per_kind_, stages_;
  std::vector<int> values_;
};

// The actions `action` waits for, per the dependency rules in the header.
std::vector<Action> dependencies(const Action& action, int stages) {
  if (action.kind == Action::Kind::kWeight) return {Action::backward(action.micro_batch, action.stage)};
  if (action.kind == Action::Kind::kForward) {
    if (action.stage == 0) return {};
    return {Action::forward(action.micro_batch, action.stage - 1)};
  }
  std::vector<Action> needs = {Action::forward(action.micro_batch, action.stage)};
  if (action.stage + 1 < stages) {
    needs.push_back(Action::backward(action.micro_batch, action.stage + 1));
  }
  return needs;
}

// The first action `action` waits for that has not finished by `tick` (finished_at: the first
// tick after each action ran, -1 before it runs), or nullopt when it may start.
std::optional<Action> unfinished_dependency(const Action& action, int stages, ActionMap& finished_at, int tick) {
  for (const Action& need : dependencies(action, stages)) {
    if (finished_at[need] == -1 || finished_at[need] > tick) return need;
  }
  return std::nullopt;
}

// Ranges, ownership and exactly-once.
void check_actions(const TrainingSchedule& schedule) {
  const int stages = schedule.stages();
  ActionMap listed_at(schedule.micro_batches, stages, -1);
  for (size_t d = 0; d < schedule.per_device.size(); ++d) {
    const auto& actions = schedule.per_device[d];
    for (size_t k = 0; k < actions.size(); ++k) {
      const Action& action = actions[k];
      if (action.micro_batch < 0 || action.micro_batch >= schedule.micro_batches) {
        throw std::invalid_argument(at(schedule, d, k) + ": micro-batch outside [0, " +
                                    std::to_string(schedule.micro_batches) + ")");
      }
      if (action.stage < 0 || action.stage >= stages) {
        throw std::invalid_argument(at(schedule, d, k) + ": stage outside [0, " +
                                    std::to_string(stages) + ")");
      }
      if (action.kind == Action::Kind::kWeight && !schedule.split_backward) {
        throw std::invalid_argument(at(schedule, d, k) + ": a W pass in a schedule whose backward is not split");
      }
      const int owner = schedule.device_of(action.stage);
      if (owner != static_cast<int>(d)) {
        throw std::invalid_argument(at(schedule, d, k) + ": stage " + std::to_string(action.stage) +
                                    " belongs to device " + std::to_string(owner));
      }
      int& first = listed_at[action];
      if (first != -1) {
        throw std::invalid_argument(at(schedule, d, k) + ": already listed as action " +
                                    std::to_string(first));
      }
      first = static_cast<int>(k);
    }
  }
  std::vector<Action::Kind> kinds = {Action::Kind::kForward, Action::Kind::kBackward};
  if (schedule.split_backward) kinds.push_back(Action::Kind::kWeight);
  for (const Action::Kind kind : kinds) {
    for (int s = 0; s < stages; ++s) {
      for (int i = 0; i < schedule.micro_batches; ++i) {
        const Action action{kind, i, s};
        if (listed_at[action] == -1) {
          throw std::invalid_argument(context(schedule) + ": device " + std::to_string(schedule.device_of(s)) +
                                      " never runs the " + describe(action, schedule.split_backward));
        }
      }
    }
  }
}

// When each action of a schedule runs on a clock: [start, end) ticks on its device.
struct ClockRun {
  std::vector<std::vector<std::pair<int, int>>> spans;  // [device][position in its list]
  int end = 0;                                          // the last action's end
};

// Runs every device's list on a clock, each action holding its device for ticks_of(action) >= 1
// ticks and starting at the first tick when its device is free and its dependencies have finished.
// On a deadlock (no device busy, none can start its next action, and some have actions left)
// throws, naming each stuck device and what it waits for. Assumes check_actions passed, so every
// dependency is listed exactly once somewhere.
ClockRun run_on_clock(const TrainingSchedule& schedule, const std::function<int(const Action&)>& ticks_of) {
  const int stages = schedule.stages();
  const size_t devices = schedule.per_device.size();
  ActionMap finished_at(schedule.micro_batches, stages, -1);  // the first tick after it ran
  std::vector<size_t> next(devices, 0);
  std::vector<int> busy_until(devices, 0);
  ClockRun run;
  run.spans.resize(devices);
  size_t remaining = 0;
  for (const auto& actions : schedule.per_device) remaining += actions.size();

  // From one tick at which an action may start (one has just finished) to the next.
  for (int tick = 0; remaining > 0;) {
    std::string stuck;
    for (size_t d = 0; d < devices; ++d) {
      if (busy_until[d] > tick || next[d] == schedule.per_device[d].size()) continue;
      const Action& action = schedule.per_device[d][next[d]];
      const std::optional<Action> missing = unfinished_dependency(action, stages, finished_at, tick);
      if (!missing) {
        // An action lasts a tick at least, so nothing that depends on it starts in this tick.
        finished_at[action] = busy_until[d] = tick + ticks_of(action);
        run.spans[d].emplace_back(tick, busy_until[d]);
        ++next[d];
        --remaining;
      } else {
        stuck += std::string(stuck.empty() ? "" : "; ") + "device " + std::to_string(d) + " waits at action " +
                 std::to_string(next[d]) + " (" + describe(action, schedule.split_backward) + ") for the " +
                 describe(*missing, schedule.split_backward);
      }
    }
    int later = -1;
    for (int until : busy_until) {
      if (until > tick && (later == -1 || until < later)) later = until;
    }
    if (later == -1 && remaining > 0) {
      throw std::invalid_argument(context(schedule) + ": deadlock at tick " + std::to_string(tick) + ": " + stuck);
    }
    tick = later;
  }
  run.end = busy_until.empty() ? 0 : *std::max_element(busy_until.begin(), busy_until.end());
  return run;
}

// The same as slots, one per tick until the last action ends (nullopt = idle).
std::vector<std::vector<std::optional<Action>>> run_clock(const TrainingSchedule& schedule,
                                                          const std::function<int(const Action&)>& ticks_of) {
  const ClockRun run = run_on_clock(schedule, ticks_of);
  std::vector<std::vector<std::optional<Action>>> slots(run.spans.size(),
                                                        std::vector<std::optional<Action>>(run.end));
  for (size_t d = 0; d < run.spans.size(); ++d) {
    for (size_t k = 0; k < run.spans[d].size(); ++k) {
      for (int t = run.spans[d][k].first; t < run.spans[d][k].second; ++t) slots[d][t] = schedule.per_device[d][k];
    }
  }
  return slots;
}

std::vector<std::vector<std::optional<Action>>> run_unit_time(const TrainingSchedule& schedule) {
  return run_clock(schedule, [](const Action&) { return 1; });
}

// Activations each device holds at most, from its own order alone (timing cannot change it).
// Throws at the first action that takes a device above in_flight_bound.
std::vector<int> peak_in_flight(const TrainingSchedule& schedule) {
  std::vector<int> peaks;
  for (size_t d = 0; d < schedule.per_device.size(); ++d) {
    const auto& actions = schedule.per_device[d];
    int held = 0;
    int peak = 0;
    // With a split backward an activation is held until its W: the layers' inputs wait for it.
    const Action::Kind releases = schedule.split_backward ? Action::Kind::kWeight : Action::Kind::kBackward;
    for (size_t k = 0; k < actions.size(); ++k) {
      if (actions[k].kind == Action::Kind::kForward) ++held;
      if (actions[k].kind == releases) --held;
      if (held > schedule.in_flight_bound) {
        throw std::invalid_argument(at(schedule, d, k) + ": " + std::to_string(held) + " activations forwarded and not yet " +
                                    (schedule.split_backward ? "through their W pass" : "backwarded") +
                                    ", above the schedule's in_flight_bound " +
                                    std::to_string(schedule.in_flight_bound));
      }
      peak = std::max(peak, held);
    }
    peaks.push_back(peak);
  }
  return peaks;
}

}  // namespace

bool operator==(const Action& a, const Action& b) {
  return a.kind == b.kind && a.micro_batch == b.micro_batch && a.stage == b.stage;
}

bool operator!=(const Action& a, const Action& b) { return !(a == b); }

int device_of_stage(int stage, int devices) { return stage % devices; }

int chunk_of_stage(int stage, int devices) { return stage / devices; }

int device_of_stage(int stage, int devices, StagePlacement placement) {
  if (placement == StagePlacement::kV) return stage < devices ? stage : 2 * devices - 1 - stage;
  return device_of_stage(stage, devices);
}

int chunk_of_stage(int stage, int devices, StagePlacement placement) {
  if (placement == StagePlacement::kV) return stage < devices ? 0 : 1;
  return chunk_of_stage(stage, devices);
}

int TrainingSchedule::device_of(int stage) const { return device_of_stage(stage, devices, placement); }

int TrainingSchedule::chunk_of(int stage) const { return chunk_of_stage(stage, devices, placement); }

TrainingSchedule gpipe_schedule(int micro_batches, int devices) {
  return gpipe_schedule(micro_batches, devices, 1);
}

TrainingSchedule gpipe_schedule(int micro_batches, int devices, int virtual_stages) {
  check_counts("gpipe_schedule", micro_batches, devices, virtual_stages);
  TrainingSchedule schedule = empty_schedule("gpipe", micro_batches, devices, virtual_stages);
  for (int d = 0; d < devices; ++d) {
    auto& actions = schedule.per_device[static_cast<size_t>(d)];
    for (int c = 0; c < virtual_stages; ++c) {
      for (int i = 0; i < micro_batches; ++i) actions.push_back(Action::forward(i, c * devices + d));
    }
    for (int c = virtual_stages - 1; c >= 0; --c) {
      for (int i = micro_batches - 1; i >= 0; --i) actions.push_back(Action::backward(i, c * devices + d));
    }
  }
  schedule.in_flight_bound = micro_batches * virtual_stages;
  return schedule;
}

TrainingSchedule one_f_one_b_schedule(int micro_batches, int devices) {
  check_counts("one_f_one_b_schedule", micro_batches, devices, 1);
  TrainingSchedule schedule = empty_schedule("1f1b", micro_batches, devices, 1);
  for (int d = 0; d < devices; ++d) {
    auto& actions = schedule.per_device[static_cast<size_t>(d)];
    // Enough forwards in flight that the first backward arrives from the last device just as the
    // warm-up ends; the last device needs none.
    const int warmup = std::min(devices - d - 1, micro_batches);
    for (int i = 0; i < warmup; ++i) actions.push_back(Action::forward(i, d));
    for (int i = 0; i < micro_batches - warmup; ++i) {
      actions.push_back(Action::forward(warmup + i, d));
      actions.push_back(Action::backward(i, d));
    }
    for (int i = micro_batches - warmup; i < micro_batches; ++i) {
      actions.push_back(Action::backward(i, d));
    }
  }
  schedule.in_flight_bound = std::min(devices, micro_batches);
  return schedule;
}

TrainingSchedule interleaved_schedule(int micro_batches, int devices, int virtual_stages) {
  check_counts("interleaved_schedule", micro_batches, devices, virtual_stages);
  if (micro_batches % devices != 0) {
    throw std::invalid_argument(
        "interleaved_schedule: micro_batches=" + std::to_string(micro_batches) +
        " is not divisible by devices=" + std::to_string(devices) +
        "; micro-batches go through the chunks in groups of one per device");
  }
  TrainingSchedule schedule = empty_schedule("interleaved", micro_batches, devices, virtual_stages);
  const int group = devices * virtual_stages;
  const int steps = micro_batches * virtual_stages;
  // Megatron's step numbering: within each group of D * V steps, D micro-batches through chunk 0,
  // the same D through chunk 1, ...; backwards walk the chunks in reverse.
  auto step_action = [&](int k, Action::Kind kind, int d) {
    const int micro_batch = (k / group) * devices + k % devices;
    int chunk = (k % group) / devices;
    if (kind == Action::Kind::kBackward) chunk = virtual_stages - 1 - chunk;
    return Action{kind, micro_batch, chunk * devices + d};
  };
  for (int d = 0; d < devices; ++d) {
    auto& actions = schedule.per_device[static_cast<size_t>(d)];
    // (V - 1) D forwards take the first D micro-batches up to this device's last chunk;
    // 2 (D - d - 1) more cover the trip on to the last device and the gradient's trip back, so the
    // first backward's input is due as warm-up ends. Megatron core v0.7: with M == D every step is
    // warm-up; later versions drop that special case, which changes devices d > 0 only.
    const int warmup =
        micro_batches == devices
            ? steps
            : std::min(2 * (devices - d - 1) + (virtual_stages - 1) * devices, steps);
    for (int k = 0; k < warmup; ++k) actions.push_back(step_action(k, Action::Kind::kForward, d));
    for (int k = 0; k < steps - warmup; ++k) {
      actions.push_back(step_action(warmup + k, Action::Kind::kForward, d));
      actions.push_back(step_action(k, Action::Kind::kBackward, d));
    }
    for (int k = steps - warmup; k < steps; ++k) {
      actions.push_back(step_action(k, Action::Kind::kBackward, d));
    }
  }
  schedule.in_flight_bound = std::min(steps, (virtual_stages + 1) * devices - 1);
  return schedule;
}

TrainingSchedule zb1p_schedule(int micro_batches, int devices) {
  check_counts("zb1p_schedule", micro_batches, devices, 1);
  TrainingSchedule schedule = one_f_one_b_schedule(micro_batches, devices);
  schedule.name = "zb1p";
  schedule.split_backward = true;
  for (int d = 0; d < devices; ++d) {
    std::vector<Action>& actions = schedule.per_device[static_cast<size_t>(d)];
    std::vector<Action> split;
    int backwards = 0;
    for (const Action& action : actions) {
      split.push_back(action);
      if (action.kind != Action::Kind::kBackward) continue;
      // Device d lets d W passes wait: as many as the warm-up forwards it holds fewer than device 0.
      const int delayed = backwards++ - d;
      if (delayed >= 0) split.push_back(Action::weight(delayed, d));
    }
    for (int i = std::max(0, micro_batches - d); i < micro_batches; ++i) split.push_back(Action::weight(i, d));
    actions = std::move(split);
  }
  return schedule;  // in_flight_bound min(D, M), 1F1B's
}

namespace {

// zbv_schedule's list scheduler on the clock of `ticks_of`.
TrainingSchedule zbv_list_schedule(int micro_batches, int devices, const std::function<int(const Action&)>& ticks_of) {
  TrainingSchedule schedule = empty_schedule("zbv", micro_batches, devices, 2);
  schedule.placement = StagePlacement::kV;
  schedule.split_backward = true;
  schedule.in_flight_bound = std::min(2 * devices, 2 * micro_batches);
  const int S = schedule.stages(), M = micro_batches;
  ActionMap finished_at(M, S, -1);
  std::vector<int> next_forward(S, 0), next_backward(S, 0), held(devices, 0), free_at(devices, 0);
  std::vector<std::vector<Action>> waiting_w(devices);  // B done, W not yet, oldest first
  int remaining = 3 * M * S;
  for (int now = 0; remaining > 0;) {
    auto ready = [&](const Action& a) { return !unfinished_dependency(a, S, finished_at, now); };
    for (int d = 0; d < devices; ++d) {
      if (free_at[d] > now) continue;
      // Gradients toward stage 0 first (the chunk the previous device waits for), then
      // activations toward the loss (the later chunk first): both unblock other devices sooner.
      const int later = 2 * devices - 1 - d, earlier = d;
      std::optional<Action> pick;
      for (int s : {earlier, later}) {
        const int i = next_backward[s];
        if (pick || i >= M) continue;
        if (ready(Action::backward(i, s))) pick = Action::backward(i, s);
      }
      for (int s : {later, earlier}) {
        const int i = next_forward[s];
        if (pick || i >= M || held[d] >= schedule.in_flight_bound) continue;
        // Keep room on the later chunk for the micro-batches started on the earlier one: were the
        // earlier chunk to fill the bound, no later forward could start and nothing would free a place.
        if (s == earlier && next_forward[earlier] + 1 - next_forward[later] >= schedule.in_flight_bound) continue;
        if (ready(Action::forward(i, s))) pick = Action::forward(i, s);
      }
      if (!pick && !waiting_w[d].empty()) {
        pick = waiting_w[d].front();
        waiting_w[d].erase(waiting_w[d].begin());
      }
      if (!pick) continue;
      switch (pick->kind) {
        case Action::Kind::kForward: ++next_forward[pick->stage]; ++held[d]; break;
        case Action::Kind::kBackward:
          ++next_backward[pick->stage];
          waiting_w[d].push_back(Action::weight(pick->micro_batch, pick->stage));
          break;
        case Action::Kind::kWeight: --held[d]; break;
      }
      schedule.per_device[static_cast<size_t>(d)].push_back(*pick);
      // At least a tick later: nothing depends on an action that starts at the same time.
      finished_at[*pick] = free_at[d] = now + ticks_of(*pick);
      --remaining;
    }
    // On to the next time an action finishes: until then nothing new becomes ready.
    int next = -1;
    for (int t : free_at) {
      if (t > now && (next == -1 || t < next)) next = t;
    }
    if (next == -1 && remaining > 0) {
      throw std::logic_error("zbv_schedule: the list scheduler made no progress (M=" + std::to_string(M) +
                             ", D=" + std::to_string(devices) + ")");
    }
    now = next;
  }
  return schedule;
}

}  // namespace

TrainingSchedule zbv_schedule(int micro_batches, int devices, const std::vector<ActionTicks>& stage_ticks) {
  check_counts("zbv_schedule", micro_batches, devices, 1);
  auto unit = [](const Action&) { return 1; };
  if (stage_ticks.empty()) return zbv_list_schedule(micro_batches, devices, unit);
  check_stage_ticks("zbv_schedule", stage_ticks, 2 * devices);
  auto ticks_of = [&](const Action& a) { return stage_ticks_of(stage_ticks[static_cast<size_t>(a.stage)], a, true); };
  // A greedy order is not always better on the clock it was made for: keep the paper's order
  // where the stages' ticks run it faster.
  TrainingSchedule by_ticks = zbv_list_schedule(micro_batches, devices, ticks_of);
  TrainingSchedule by_units = zbv_list_schedule(micro_batches, devices, unit);
  return run_on_clock(by_ticks, ticks_of).end < run_on_clock(by_units, ticks_of).end ? by_ticks : by_units;
}

void validate_schedule(const TrainingSchedule& schedule) {
  if (schedule.micro_batches < 1 || schedule.devices < 1 || schedule.virtual_stages < 1) {
    throw std::invalid_argument(context(schedule) +
                                ": need at least one micro-batch, device and virtual stage");
  }
  if (schedule.per_device.size() != static_cast<size_t>(schedule.devices)) {
    throw std::invalid_argument(
        context(schedule) + ": per_device has " + std::to_string(schedule.per_device.size()) +
        " lists, expected one per device (" + std::to_string(schedule.devices) + ")");
  }
  check_actions(schedule);
  run_unit_time(schedule);
  peak_in_flight(schedule);
}

int64_t Timeline::total_slots() const { return static_cast<int64_t>(slots.size()) * ticks; }

int64_t Timeline::idle_slots() const {
  int64_t idle = 0;
  for (const auto& row : slots) {
    idle += std::count_if(row.begin(), row.end(), [](const auto& slot) { return !slot; });
  }
  return idle;
}

namespace {

Timeline timeline_of(const TrainingSchedule& schedule, const std::function<int(const Action&)>& ticks_of) {
  validate_schedule(schedule);
  Timeline timeline;
  timeline.devices = schedule.devices;
  timeline.virtual_stages = schedule.virtual_stages;
  timeline.placement = schedule.placement;
  timeline.slots = run_clock(schedule, ticks_of);
  timeline.ticks = timeline.slots.empty() ? 0 : static_cast<int>(timeline.slots[0].size());
  const int64_t total = timeline.total_slots();
  timeline.bubble =
      total == 0 ? 0.0 : static_cast<double>(timeline.idle_slots()) / static_cast<double>(total);
  timeline.peak_in_flight = peak_in_flight(schedule);
  return timeline;
}

}  // namespace

Timeline simulate_unit_time(const TrainingSchedule& schedule) {
  return timeline_of(schedule, [](const Action&) { return 1; });
}

Timeline simulate(const TrainingSchedule& schedule, const ActionTicks& ticks) {
  if (ticks.forward < 1 || ticks.input_gradient < 1 || ticks.weight_gradient < 1) {
    throw std::invalid_argument("simulate: every action takes a tick at least, got F " + std::to_string(ticks.forward) +
                                ", B " + std::to_string(ticks.input_gradient) + ", W " +
                                std::to_string(ticks.weight_gradient));
  }
  const bool split = schedule.split_backward;
  return timeline_of(schedule, [&](const Action& action) { return stage_ticks_of(ticks, action, split); });
}

Timeline simulate(const TrainingSchedule& schedule, const std::vector<ActionTicks>& stage_ticks) {
  check_stage_ticks("simulate", stage_ticks, schedule.stages());
  const bool split = schedule.split_backward;
  return timeline_of(schedule, [&](const Action& action) {
    return stage_ticks_of(stage_ticks[static_cast<size_t>(action.stage)], action, split);
  });
}

std::string action_label(const Action& action, int devices, int virtual_stages, StagePlacement placement) {
  static const char* const kLetters[] = {"F", "B", "W"};
  std::string label = kLetters[static_cast<int>(action.kind)] + std::to_string(action.micro_batch);
  if (virtual_stages > 1) label += "." + std::to_string(chunk_of_stage(action.stage, devices, placement));
  return label;
}

std::string action_label(const Action& action, const TrainingSchedule& schedule) {
  return action_label(action, schedule.devices, schedule.virtual_stages, schedule.placement);
}

std::string format_actions(const TrainingSchedule& schedule) {
  std::string out;
  for (size_t d = 0; d < schedule.per_device.size(); ++d) {
    out += "device " + std::to_string(d) + ":";
    for (const Action& action : schedule.per_device[d]) {
      out += " " + action_label(action, schedule);
    }
    out += "\n";
  }
  return out;
}

std::string format_timeline(const Timeline& timeline) {
  const int devices = static_cast<int>(timeline.slots.size());
  std::vector<std::string> header;
  for (int k = 0; k < timeline.ticks; ++k) header.push_back(std::to_string(k));
  std::vector<std::vector<std::string>> rows;
  for (const auto& row : timeline.slots) {
    rows.emplace_back();
    for (const auto& slot : row) {
      rows.back().push_back(slot ? action_label(*slot, devices, timeline.virtual_stages, timeline.placement) : ".");
    }
  }
  return format_rows("clock", header, rows, "device ");
}

ScheduleKind parse_schedule_kind(const std::string& text) {
  for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
                            ScheduleKind::kZb1p, ScheduleKind::kZbv}) {
    if (text == to_string(kind)) return kind;
  }
  throw std::invalid_argument("--pipeline_schedule must be gpipe, 1f1b, interleaved, zb1p or zbv, got '" + text + "'");
}

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe: return "gpipe";
    case ScheduleKind::kOneFOneB: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZb1p: return "zb1p";
    case ScheduleKind::kZbv: return "zbv";
  }
  return "?";
}

bool splits_backward(ScheduleKind kind) { return kind == ScheduleKind::kZb1p || kind == ScheduleKind::kZbv; }

StagePlacement placement_of(ScheduleKind kind) {
  return kind == ScheduleKind::kZbv ? StagePlacement::kV : StagePlacement::kLoop;
}

int chunks_per_device(ScheduleKind kind, int virtual_stages) {
  return kind == ScheduleKind::kZbv ? 2 : virtual_stages;
}

void check_schedule_kind(ScheduleKind kind, int virtual_stages) {
  if (virtual_stages < 1) {
    throw std::invalid_argument("--virtual_stages must be >= 1, got " + std::to_string(virtual_stages));
  }
  if (kind == ScheduleKind::kZbv) {
    if (virtual_stages > 2) {
      throw std::invalid_argument("--virtual_stages " + std::to_string(virtual_stages) +
                                  " does not fit --pipeline_schedule zbv, which runs two chunks per device in a V "
                                  "(give 1 or 2)");
    }
    return;
  }
  if (kind != ScheduleKind::kInterleaved && virtual_stages != 1) {
    throw std::invalid_argument("--virtual_stages " + std::to_string(virtual_stages) +
                                " needs --pipeline_schedule interleaved (got " + to_string(kind) +
                                "); gpipe, 1f1b and zb1p run one stage per device");
  }
}

void check_schedule_flags(ScheduleKind kind, int micro_batches, int devices, int virtual_stages) {
  if (micro_batches < 1) throw std::invalid_argument("--n_chunk must be >= 1, got " + std::to_string(micro_batches));
  check_schedule_kind(kind, virtual_stages);
  if (kind == ScheduleKind::kInterleaved && micro_batches % devices != 0) {
    throw std::invalid_argument("--pipeline_schedule interleaved needs --n_chunk to be a multiple of the " +
                                std::to_string(devices) + " devices (Megatron's rule), got " +
                                std::to_string(micro_batches));
  }
}

}  // namespace harness::pipeline
