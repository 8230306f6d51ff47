// --debug_sync: a c10d backend that, before each collective, has every rank of the group compare
// a fingerprint of it (sequence number, operation, reduce op or root, each tensor's dtype and
// shape) through the group's store, in the spirit of TORCH_DISTRIBUTED_DEBUG=DETAIL. Ranks that
// would issue different collectives (and hang, or reduce mismatched buffers) fail instead, each
// with every rank's view of the collective; a rank that never arrives is named after the timeout.
//
// Point-to-point send/recv are forwarded unchecked (their two sides differ by nature), as
// PyTorch's ProcessGroupWrapper does. The cost is one store round trip per collective per rank.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace harness::data_parallel {

// "#<seq> <op>(<detail>) <dtype>[d0,d1,...] ...", what the ranks compare; e.g.
// "#3 allreduce(SUM) float32[1024]". Exposed for tests.
std::string collective_fingerprint(uint64_t sequence, const std::string& op, const std::string& detail,
                                   const std::vector<at::Tensor>& tensors);

class DebugSyncBackend : public c10d::Backend {
 public:
  // `store` is the group's own (keys go under "harness/debug_sync/"); `group_name` says which
  // group in errors ("the world group", ...).
  DebugSyncBackend(c10::intrusive_ptr<c10d::Backend> inner, c10::intrusive_ptr<c10d::Store> store,
                   std::string group_name, std::chrono::milliseconds timeout);

  const std::string getBackendName() const override { return inner_->getBackendName(); }
  void setTimeout(std::chrono::milliseconds timeout) override;
  const c10::intrusive_ptr<c10d::Backend>& inner() const { return inner_; }
  // Collectives checked so far.
  uint64_t checked() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  // Forwarded as they are (not collectives). Coalescing (start/endCoalescing) is not offered:
  // the collectives inside a coalesced group would need one fingerprint for the group.
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }
  c10d::ErrorType getError() override { return inner_->getError(); }
  void waitForPendingWorks() override { inner_->waitForPendingWorks(); }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // Publishes this rank's fingerprint of the next collective, waits for every rank's, and throws
  // std::runtime_error (naming each rank's view, or the ranks that never arrived) unless they are
  // all equal. The caller holds mutex_ through the collective's launch, so that the sequence
  // numbers follow the order in which the collectives reach the inner backend.
  void check(const std::string& op, const std::string& detail, const std::vector<at::Tensor>& tensors);

  c10::intrusive_ptr<c10d::Backend> inner_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string group_name_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  uint64_t sequence_ = 0;
};

}  // namespace harness::data_parallel
