// Pipeline stages' sends and receives from a schedule, and their rendezvous check (see p2p_plan.h).
#include "harness/pipeline/p2p_plan.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace harness::pipeline {
namespace {

using Op = P2POp;
using Message = P2PMessage;

// The receives `action` needs before it runs on `device`, and the sends it owes after. A W pass
// exchanges nothing: its inputs stayed on the device.
std::vector<Op> receives_of(const Action& action, int device, const TrainingSchedule& schedule) {
  const int S = schedule.stages();
  if (action.kind == Action::Kind::kWeight) return {};
  if (action.kind == Action::Kind::kForward) {
    if (action.stage == 0 || schedule.device_of(action.stage - 1) == device) return {};
    return {{Op::Kind::kRecv, schedule.device_of(action.stage - 1),
             {Message::Kind::kActivation, action.micro_batch, action.stage - 1}}};
  }
  if (action.stage == S - 1 || schedule.device_of(action.stage + 1) == device) return {};
  return {{Op::Kind::kRecv, schedule.device_of(action.stage + 1),
           {Message::Kind::kGradient, action.micro_batch, action.stage + 1}}};
}

std::vector<Op> sends_of(const Action& action, int device, const TrainingSchedule& schedule) {
  const int S = schedule.stages();
  if (action.kind == Action::Kind::kWeight) return {};
  if (action.kind == Action::Kind::kForward) {
    if (action.stage == S - 1 || schedule.device_of(action.stage + 1) == device) return {};
    return {{Op::Kind::kSend, schedule.device_of(action.stage + 1),
             {Message::Kind::kActivation, action.micro_batch, action.stage}}};
  }
  if (action.stage == 0 || schedule.device_of(action.stage - 1) == device) return {};
  return {{Op::Kind::kSend, schedule.device_of(action.stage - 1),
           {Message::Kind::kGradient, action.micro_batch, action.stage}}};
}

void append_exchange(std::vector<P2PStep>& steps, std::vector<Op> ops, P2PGrouping grouping) {
  if (ops.empty()) return;
  if (grouping == P2PGrouping::kBatched) {
    P2PStep step;
    step.exchange = std::move(ops);
    steps.push_back(std::move(step));
    return;
  }
  for (Op& op : ops) {
    P2PStep step;
    step.exchange = {op};
    steps.push_back(std::move(step));
  }
}

std::string context(const P2PPlan& plan) {
  const TrainingSchedule& s = plan.schedule;
  return "validate_p2p_plan(" + s.name + ", M=" + std::to_string(s.micro_batches) + ", D=" +
         std::to_string(s.devices) + ", V=" + std::to_string(s.virtual_stages) + ")";
}


// Every message sent exactly once and received exactly once, between the same two devices.
void check_pairs(const P2PPlan& plan) {
  struct Ends {
    int sends = 0, recvs = 0, sender = -1, receiver = -1, send_peer = -1, recv_peer = -1;
    Message message;
  };
  std::map<Message, Ends> ends;
  for (size_t d = 0; d < plan.per_device.size(); ++d) {
    for (const P2PStep& step : plan.per_device[d]) {
      for (const Op& op : step.exchange) {
        Ends& e = ends[op.message];
        e.message = op.message;
        if (op.kind == Op::Kind::kSend) {
          ++e.sends;
          e.sender = static_cast<int>(d);
          e.send_peer = op.peer;
        } else {
          ++e.recvs;
          e.receiver = static_cast<int>(d);
          e.recv_peer = op.peer;
        }
      }
    }
  }
  for (const auto& [key, e] : ends) {
    const std::string what = context(plan) + ": message " + p2p_message_label(e.message);
    if (e.sends != 1 || e.recvs != 1) {
      throw std::invalid_argument(what + " is sent " + std::to_string(e.sends) + " times and received " +
                                  std::to_string(e.recvs) + " times (expected once each)");
    }
    if (e.send_peer != e.receiver || e.recv_peer != e.sender) {
      throw std::invalid_argument(what + ": device " + std::to_string(e.sender) + " sends it to device " +
                                  std::to_string(e.send_peer) + " but device " + std::to_string(e.receiver) +
                                  " receives it from device " + std::to_string(e.recv_peer));
    }
  }
}

// NCCL matches the sends from one device to another with the other's receives by order, not by
// name: each ordered pair must post its messages in one order at both ends.
void check_pair_order(const P2PPlan& plan) {
  std::map<std::pair<int, int>, std::vector<Message>> sent, received;  // (from, to) -> messages
  for (size_t d = 0; d < plan.per_device.size(); ++d) {
    for (const P2PStep& step : plan.per_device[d]) {
      for (const Op& op : step.exchange) {
        if (op.kind == Op::Kind::kSend) {
          sent[{static_cast<int>(d), op.peer}].push_back(op.message);
        } else {
          received[{op.peer, static_cast<int>(d)}].push_back(op.message);
        }
      }
    }
  }
  for (const auto& [pair, messages] : sent) {
    const std::vector<Message>& other = received[pair];
    for (size_t k = 0; k < messages.size() && k < other.size(); ++k) {
      if (messages[k] == other[k]) continue;
      throw std::invalid_argument(context(plan) + ": device " + std::to_string(pair.first) + "'s message " +
                                  std::to_string(k) + " to device " + std::to_string(pair.second) + " is " +
                                  p2p_message_label(messages[k]) + " but device " + std::to_string(pair.second) +
                                  " receives " + p2p_message_label(other[k]) +
                                  " there (the two ends must post each pair's messages in one order)");
    }
  }
}

}  // namespace

std::string p2p_message_label(const P2PMessage& m) {
  const int to = m.kind == Message::Kind::kActivation ? m.from_stage + 1 : m.from_stage - 1;
  return std::string(m.kind == Message::Kind::kActivation ? "act " : "grad ") + std::to_string(m.micro_batch) +
         " s" + std::to_string(m.from_stage) + "->s" + std::to_string(to);
}

std::string p2p_op_label(const P2POp& op) {
  return std::string(op.kind == Op::Kind::kSend ? "send " : "recv ") + p2p_message_label(op.message) +
         (op.kind == Op::Kind::kSend ? " to " : " from ") + std::to_string(op.peer);
}

std::string p2p_exchange_label(const std::vector<Op>& ops) {
  std::string text = "[";
  for (size_t k = 0; k < ops.size(); ++k) text += (k ? ", " : "") + p2p_op_label(ops[k]);
  return text + "]";
}

P2PPlan make_p2p_plan(const TrainingSchedule& schedule, P2PGrouping grouping) {
  const Timeline timeline = simulate_unit_time(schedule);  // validates the schedule
  // The tick each action runs at, by (kind, micro-batch, stage).
  std::map<std::tuple<int, int, int>, int> tick_of;
  for (const auto& row : timeline.slots) {
    for (int t = 0; t < static_cast<int>(row.size()); ++t) {
      if (row[t]) tick_of[{static_cast<int>(row[t]->kind), row[t]->micro_batch, row[t]->stage}] = t;
    }
  }
  auto tick = [&](const Action& a) { return tick_of.at({static_cast<int>(a.kind), a.micro_batch, a.stage}); };
  // The action that sends `message` (the sender's tick decides when the receive is posted).
  auto sender_of = [](const Message& m) {
    return m.kind == Message::Kind::kActivation ? Action::forward(m.micro_batch, m.from_stage)
                                                : Action::backward(m.micro_batch, m.from_stage);
  };

  P2PPlan plan;
  plan.schedule = schedule;
  plan.per_device.resize(schedule.per_device.size());
  for (size_t d = 0; d < schedule.per_device.size(); ++d) {
    const int device = static_cast<int>(d);
    const std::vector<Action>& actions = schedule.per_device[d];
    // exchanges[k]: the group posted before action k (k = actions.size(): after the last one).
    std::vector<std::vector<Op>> exchanges(actions.size() + 1);
    for (size_t k = 0; k < actions.size(); ++k) {
      for (Op& send : sends_of(actions[k], device, schedule)) exchanges[k + 1].push_back(send);
      // A receive is posted in the group before the first action of this device that runs once
      // the message is ready in the unit-time run (the tick after its sender), and at the latest
      // right before the action that needs it: posted then, it meets its send at about the time
      // the sender posts it, so neither end holds the other's next exchange back.
      for (Op& receive : receives_of(actions[k], device, schedule)) {
        const int ready = tick(sender_of(receive.message)) + 1;
        size_t slot = 0;
        while (slot < k && tick(actions[slot]) < ready) ++slot;
        exchanges[slot].push_back(receive);
      }
    }
    std::vector<P2PStep>& steps = plan.per_device[d];
    for (size_t k = 0; k <= actions.size(); ++k) {
      // Sends first, then the receives in the order their senders run, so that each pair of devices
      // posts its messages in one order at both ends (NCCL matches point-to-point by order).
      std::stable_sort(exchanges[k].begin(), exchanges[k].end(), [&](const Op& a, const Op& b) {
        if (a.kind != b.kind) return a.kind == Op::Kind::kSend;
        return a.kind == Op::Kind::kRecv && tick(sender_of(a.message)) < tick(sender_of(b.message));
      });
      append_exchange(steps, std::move(exchanges[k]), grouping);
      if (k < actions.size()) {
        P2PStep compute;
        compute.action = actions[k];
        steps.push_back(compute);
      }
    }
  }
  return plan;
}

void validate_p2p_plan(const P2PPlan& plan) {
  check_pairs(plan);
  check_pair_order(plan);
  const size_t D = plan.per_device.size();
  std::vector<size_t> at(D, 0);                 // each device's current step
  std::vector<std::vector<bool>> completed(D);  // the current exchange's ops that have met their match
  auto current_exchange = [&](size_t d) -> const P2PStep* {
    if (at[d] >= plan.per_device[d].size()) return nullptr;
    const P2PStep& step = plan.per_device[d][at[d]];
    return step.is_exchange() ? &step : nullptr;
  };
  auto advance = [&](size_t d) {
    ++at[d];
    const P2PStep* next = current_exchange(d);
    completed[d].assign(next ? next->exchange.size() : 0, false);
  };
  for (size_t d = 0; d < D; ++d) {
    const P2PStep* first = current_exchange(d);
    completed[d].assign(first ? first->exchange.size() : 0, false);
  }
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t d = 0; d < D; ++d) {
      while (at[d] < plan.per_device[d].size()) {
        const P2PStep* mine = current_exchange(d);
        if (mine == nullptr) {  // a compute action: its inputs arrived in the exchange before it
          advance(d);
          progress = true;
          continue;
        }
        for (size_t k = 0; k < mine->exchange.size(); ++k) {
          if (completed[d][k]) continue;
          const Op& op = mine->exchange[k];
          const size_t peer = static_cast<size_t>(op.peer);
          const P2PStep* theirs = peer < D ? current_exchange(peer) : nullptr;
          if (theirs == nullptr) continue;
          for (size_t j = 0; j < theirs->exchange.size(); ++j) {
            const Op& other = theirs->exchange[j];
            if (!completed[peer][j] && other.kind != op.kind && other.message == op.message &&
                static_cast<size_t>(other.peer) == d) {
              completed[d][k] = completed[peer][j] = true;
              progress = true;
              break;
            }
          }
        }
        bool all = true;
        for (bool c : completed[d]) all = all && c;
        if (!all) break;
        advance(d);
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (size_t d = 0; d < D; ++d) {
    const P2PStep* mine = current_exchange(d);
    if (mine == nullptr) continue;
    stuck << "; device " << d << " waits at step " << at[d] << " " << p2p_exchange_label(mine->exchange) << " for";
    for (size_t k = 0; k < mine->exchange.size(); ++k) {
      if (!completed[d][k]) stuck << " " << p2p_op_label(mine->exchange[k]);
    }
  }
  if (!stuck.str().empty()) {
    throw std::invalid_argument(context(plan) + ": the sends and receives deadlock" + stuck.str());
  }
}

std::string format_p2p_plan(const P2PPlan& plan) {
  std::ostringstream out;
  const TrainingSchedule& s = plan.schedule;
  for (size_t d = 0; d < plan.per_device.size(); ++d) {
    out << "device " << d << ":";
    for (const P2PStep& step : plan.per_device[d]) {
      out << " " << (step.is_exchange() ? p2p_exchange_label(step.exchange)
                                         : action_label(step.action, s));
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace harness::pipeline
