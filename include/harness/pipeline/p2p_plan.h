// What pipeline stages that are processes send and receive, in order, derived from a schedule's
// per-device action lists, and a validator that runs every rank's list under the strictest
// transport semantics (a send completes only once the peer has posted the matching receive, as
// NCCL's may) and proves that every send meets its receive with no cycle of waits.
//
// Ordering stays in the schedule (training_schedule.h); this turns it into exchanges, and a
// transport (in-process hand-over, c10d send/recv) carries them out. Between two compute actions a
// rank posts one group, issued together and waited for together (c10d's batched isend/irecv;
// Megatron's send_forward_recv_backward): the sends of the action it just ran, and each receive
// whose sender has run by then in the schedule's unit-time run (at the latest, right before the
// action that needs it). Both ends thus post a message at about the same point. Posted one by one
// instead, 1F1B's steady state deadlocks: device d sends micro-batch i's activation to d + 1 and
// waits, while d + 1 sends i - 1's gradient back and waits (the hang of PyTorch pipelining's PR
// #127332); and receives posted only right before the action that needs them deadlock GPipe over
// V > 1 chunks, whose first device sends every activation before it takes any back.
// validate_p2p_plan finds both, and the tests run it over P <= 8, V <= 4, M <= 16 for every
// schedule.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {

// One tensor crossing a stage boundary: micro-batch `micro_batch`'s activation from stage
// `from_stage` to `from_stage` + 1, or its gradient from `from_stage` to `from_stage` - 1.
struct P2PMessage {
  enum class Kind { kActivation, kGradient };
  Kind kind = Kind::kActivation;
  int micro_batch = 0;
  int from_stage = 0;
  bool operator==(const P2PMessage& other) const {
    return kind == other.kind && micro_batch == other.micro_batch && from_stage == other.from_stage;
  }
  // Messages as map keys: activations first, then by micro-batch and stage.
  bool operator<(const P2PMessage& other) const {
    return std::tie(kind, micro_batch, from_stage) < std::tie(other.kind, other.micro_batch, other.from_stage);
  }
};

struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = 0;  // the device (pipeline rank) on the other end
  P2PMessage message;
};

// One entry of a rank's program: a compute action, or a group of sends and receives posted
// together and waited for together (`exchange` non-empty, `action` unused).
struct P2PStep {
  Action action;
  std::vector<P2POp> exchange;
  bool is_exchange() const { return !exchange.empty(); }
};

struct P2PPlan {
  TrainingSchedule schedule;
  std::vector<std::vector<P2PStep>> per_device;  // [device] -> steps in order
};

// How exchanges are grouped: kBatched as described above; kOneByOne posts each send and receive
// as its own blocking group in the same order (sends of the action just run, then receives of the
// next), for showing what the batching prevents.
enum class P2PGrouping { kBatched, kOneByOne };

// The plan of a valid schedule (validate_schedule is called first). Stages on one device exchange
// nothing (a device's consecutive stages hand over in memory).
P2PPlan make_p2p_plan(const TrainingSchedule& schedule, P2PGrouping grouping = P2PGrouping::kBatched);

// Runs every device's steps with rendezvous semantics: a posted group's ops each complete when the
// peer's posted group holds the matching op (send against receive of the same message), and a
// device moves past a group once all its ops have completed. Throws std::invalid_argument when the
// devices can get no further (naming each waiting device, its step and what it waits for), when
// a send has no receive or a receive no send anywhere (naming the message), or when the two ends
// of a pair of devices post its messages in different orders (NCCL matches by order).
void validate_p2p_plan(const P2PPlan& plan);

// "act 3 s1->s2", "grad 3 s2->s1"
std::string p2p_message_label(const P2PMessage& message);

// "send act 3 s1->s2 to 1", "recv grad 3 s2->s1 from 1"
std::string p2p_op_label(const P2POp& op);

// "[send act 0 s0->s1 to 1, recv grad 0 s1->s0 from 1]"
std::string p2p_exchange_label(const std::vector<P2POp>& ops);

// One line per device, compute actions as action_label gives them and each exchange in brackets:
//   device 0: F0 [send act 0 s0->s1 to 1] F1 [send act 1 s0->s1 to 1, recv grad 0 s1->s0 from 1] B0 ...
std::string format_p2p_plan(const P2PPlan& plan);

}  // namespace harness::pipeline
