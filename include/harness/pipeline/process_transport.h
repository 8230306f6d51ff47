// Pipeline stages that are processes: the StageTransport (executor.h) that carries a plan's
// exchanges as c10d point-to-point sends and receives over the pipeline group, NCCL on GPUs and
// Gloo on CPUs. Each exchange group is posted together, as torch.distributed.batch_isend_irecv
// does (NCCL: one coalesced group, so that a send and a receive to the same peer cannot block each
// other on one stream, waited for at once; Gloo: every op posted before any is waited for, each
// message under a tag of its own). Under Gloo a receive is waited for only when its tensor is
// taken and a send at the plan's end (finish): a send completes only once the peer has posted its receive, so waiting for it at once
// would hold this stage until the peer reached that point of its plan, and a receive posted early
// would hold it until the peer had computed the tensor. Waiting later than the plan's exchanges
// cannot deadlock a plan that validate_p2p_plan passed (every wait moves later, no post does).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "harness/device.h"
#include "harness/pipeline/executor.h"

namespace harness::pipeline {

// --debug_sync for point-to-point: before each exchange a rank records in the group's store what
// it posts ("exchange #12 [send act 3 s0->s1 to 1, recv grad 2 s1->s0 from 1]"), so that an
// exchange that times out says what each peer was waiting for instead of only that it never
// answered. One store write per exchange.
struct P2PDebugRecord {
  c10::intrusive_ptr<c10d::Store> store;  // the pipeline group's
  std::string prefix = "harness/debug_p2p/";
};

class ProcessTransport final : public StageTransport {
 public:
  // The sizes of a message's tensor, which the receiving end allocates before the sender's data
  // arrives (for GPT-2: the micro-batch's [rows, tokens, n_embd] either way).
  using MessageShape = std::function<std::vector<int64_t>(const P2PMessage&)>;

  // `group`: the pipeline group, whose rank p is schedule device p. Tensors cross as `dtype` on
  // `device`; a tensor of another shape or dtype is refused at its send, naming the message.
  ProcessTransport(c10::intrusive_ptr<c10d::Backend> group, Device device, MessageShape shape_of,
                   at::ScalarType dtype = at::kFloat, std::optional<P2PDebugRecord> debug = std::nullopt);

  void exchange(int device, const std::vector<P2POp>& ops,
                const std::function<at::Tensor(const P2PMessage&)>& outgoing) override;
  at::Tensor take(int device, const P2PMessage& message) override;
  void finish(int device) override;

  // Bytes sent so far (what the point-to-point traffic of the run is).
  int64_t sent_bytes() const { return sent_bytes_; }

 private:
  c10::intrusive_ptr<c10d::Backend> group_;
  Device device_;
  MessageShape shape_of_;
  at::ScalarType dtype_;
  // What `peer` last recorded under --debug_sync ("posted nothing yet" when it has not).
  std::string last_posted_by(int peer) const;

  // A posted op not yet waited for: its work, the tensor c10d holds a reference to, and which
  // exchange posted it (for the error a failed wait raises).
  struct Posted {
    c10::intrusive_ptr<c10d::Work> work;  // null once waited for (or covered by NCCL's group)
    at::Tensor tensor;
    int64_t exchange = 0;
    std::string exchange_label;
    std::vector<int> peers;
  };
  void wait_for(Posted& posted, int device);

  std::map<P2PMessage, Posted> received_;
  std::vector<Posted> sending_;
  int64_t sent_bytes_ = 0;
  std::optional<P2PDebugRecord> debug_;
  int64_t exchanges_ = 0;
};

// The tag of a message under Gloo, distinct for every (kind, micro-batch, sending stage).
int p2p_tag(const P2PMessage& message);

}  // namespace harness::pipeline
