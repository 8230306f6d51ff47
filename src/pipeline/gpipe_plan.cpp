// GPipe's step as a forward plan and a backward plan, and the clock a plan runs (see gpipe_plan.h).
#include "harness/pipeline/gpipe_plan.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace harness::pipeline {

PlanHalves split_at_first_backward(const P2PPlan& plan) {
  const TrainingSchedule& schedule = plan.schedule;
  PlanHalves halves;
  for (P2PPlan* half : {&halves.forward, &halves.backward}) {
    half->schedule = schedule;
    half->schedule.per_device.assign(plan.per_device.size(), {});
    half->per_device.assign(plan.per_device.size(), {});
  }
  halves.forward.schedule.name = schedule.name + " forwards";
  halves.backward.schedule.name = schedule.name + " backwards";
  for (size_t d = 0; d < plan.per_device.size(); ++d) {
    bool backwards_begun = false;
    for (const P2PStep& step : plan.per_device[d]) {
      if (!step.is_exchange()) {
        const bool forward = step.action.kind == Action::Kind::kForward;
        if (forward && backwards_begun) {
          throw std::invalid_argument(
              "split_at_first_backward(" + schedule.name + "): device " + std::to_string(d) + " runs " +
              action_label(step.action, schedule) +
              " after a backward; only a schedule whose forwards all come first (GPipe's) splits in two");
        }
        backwards_begun = backwards_begun || !forward;
        P2PPlan& half = forward ? halves.forward : halves.backward;
        half.per_device[d].push_back(step);
        half.schedule.per_device[d].push_back(step.action);
        continue;
      }
      P2PStep activations, gradients;
      for (const P2POp& op : step.exchange) {
        (op.message.kind == P2PMessage::Kind::kActivation ? activations : gradients).exchange.push_back(op);
      }
      if (activations.is_exchange()) halves.forward.per_device[d].push_back(std::move(activations));
      if (gradients.is_exchange()) halves.backward.per_device[d].push_back(std::move(gradients));
    }
  }
  return halves;
}

const PlanHalves& gpipe_plan_halves(int m, int n) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, std::unique_ptr<PlanHalves>> made;
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<PlanHalves>& halves = made[{m, n}];
  if (!halves) {
    auto split = std::make_unique<PlanHalves>(split_at_first_backward(make_p2p_plan(gpipe_schedule(m, n))));
    validate_p2p_plan(split->forward);
    validate_p2p_plan(split->backward);
    halves = std::move(split);
  }
  return *halves;
}

std::vector<Cycle> unit_time_cycles(const P2PPlan& plan) {
  const TrainingSchedule& schedule = plan.schedule;
  const int S = schedule.stages();
  using Task = std::tuple<int, int, int>;  // (kind, micro-batch, stage)
  auto task_of = [](const Action& a) { return Task{static_cast<int>(a.kind), a.micro_batch, a.stage}; };
  std::set<Task> in_plan;
  std::vector<std::vector<Action>> actions(plan.per_device.size());
  for (size_t d = 0; d < plan.per_device.size(); ++d) {
    for (const P2PStep& step : plan.per_device[d]) {
      if (step.is_exchange()) continue;
      actions[d].push_back(step.action);
      in_plan.insert(task_of(step.action));
    }
  }
  // The tasks `a` waits for that this plan runs (the others ran before it).
  auto inputs_of = [&](const Action& a) {
    std::vector<Action> inputs;
    if (a.kind == Action::Kind::kForward) {
      if (a.stage > 0) inputs.push_back(Action::forward(a.micro_batch, a.stage - 1));
    } else {
      inputs.push_back(Action::forward(a.micro_batch, a.stage));
      if (a.stage + 1 < S) inputs.push_back(Action::backward(a.micro_batch, a.stage + 1));
    }
    auto ran_before = [&](const Action& x) { return in_plan.count(task_of(x)) == 0; };
    inputs.erase(std::remove_if(inputs.begin(), inputs.end(), ran_before), inputs.end());
    return inputs;
  };

  std::map<Task, int> tick_of;
  std::vector<size_t> next(actions.size(), 0);
  std::vector<Cycle> cycles;
  size_t left = in_plan.size();
  for (int tick = 0; left > 0; ++tick) {
    std::vector<Action> now;
    std::vector<size_t> ran;  // the devices of `now`
    for (size_t d = 0; d < actions.size(); ++d) {
      if (next[d] == actions[d].size()) continue;
      const Action& a = actions[d][next[d]];
      bool ready = true;
      for (const Action& input : inputs_of(a)) {
        auto it = tick_of.find(task_of(input));
        ready = ready && it != tick_of.end() && it->second < tick;
      }
      if (ready) {
        now.push_back(a);
        ran.push_back(d);
      }
    }
    if (now.empty()) {
      std::string waiting;
      for (size_t d = 0; d < actions.size(); ++d) {
        if (next[d] < actions[d].size()) {
          waiting += "; device " + std::to_string(d) + " at " +
                     action_label(actions[d][next[d]], schedule);
        }
      }
      throw std::invalid_argument("unit_time_cycles(" + schedule.name + "): the devices wait for each other" + waiting);
    }
    for (size_t k = 0; k < now.size(); ++k) {
      tick_of[task_of(now[k])] = tick;
      ++next[ran[k]];
      --left;
    }
    std::sort(now.begin(), now.end(), [](const Action& a, const Action& b) {
      if (a.kind != b.kind) return a.kind == Action::Kind::kForward;
      return a.kind == Action::Kind::kForward ? a.micro_batch > b.micro_batch : a.micro_batch < b.micro_batch;
    });
    Cycle cycle;
    for (const Action& a : now) cycle.emplace_back(a.micro_batch, a.stage);
    cycles.push_back(std::move(cycle));
  }
  return cycles;
}

}  // namespace harness::pipeline
