// model::ContextParallelGroup over a c10d process group (see group.h).
#include "harness/context_parallel/group.h"

#include <torch/torch.h>

#include <stdexcept>
#include <utility>

namespace harness::context_parallel {
namespace {

using Work = c10::intrusive_ptr<c10d::Work>;

// A receive and a send posted together; the tensors stay referenced until both are done.
class PostedExchange : public model::ContextParallelGroup::Exchange {
 public:
  PostedExchange(at::Tensor sent, at::Tensor received, std::vector<Work> works)
      : sent_(std::move(sent)), received_(std::move(received)), works_(std::move(works)) {}

  at::Tensor wait() override {
    for (Work& work : works_) {
      if (work) work->wait();
    }
    works_.clear();
    sent_.reset();
    return received_;
  }

 private:
  at::Tensor sent_;
  at::Tensor received_;
  std::vector<Work> works_;
};

// The ring of one: the tensor comes back, no process is involved.
class LoopbackExchange : public model::ContextParallelGroup::Exchange {
 public:
  explicit LoopbackExchange(at::Tensor tensor) : tensor_(std::move(tensor)) {}
  at::Tensor wait() override { return tensor_; }

 private:
  at::Tensor tensor_;
};

class ProcessGroupContextParallel : public model::ContextParallelGroup {
 public:
  explicit ProcessGroupContextParallel(data_parallel::DistContext cp) : cp_(std::move(cp)) {}

  int rank() const override { return cp_.rank; }
  int size() const override { return cp_.world_size; }

  std::unique_ptr<Exchange> ring_exchange(const at::Tensor& to_next) override {
    at::Tensor sent = to_next.detach().contiguous();
    if (size() == 1) return std::make_unique<LoopbackExchange>(sent.clone());
    std::vector<at::Tensor> send_buffer{sent};
    std::vector<at::Tensor> receive_buffer{at::empty_like(sent)};
    const int next = (rank() + 1) % size();
    const int previous = (rank() + size() - 1) % size();
    // Each exchange has its own tag, the same on every rank (they start exchanges in the same
    // order), so two in flight between the same pair never take each other's message.
    const int tag = static_cast<int>(exchanges_++ % kTagCycle);
    // Both are posted before anyone waits: with Gloo, every rank's receive is then already
    // waiting for its neighbour's send. NCCL needs them in one group, or the ring's pairwise
    // communicators would wait for each other round the ring.
    const bool nccl = cp_.group->getBackendName() == "nccl";
    if (nccl) cp_.group->startCoalescing();
    std::vector<Work> works{cp_.group->recv(receive_buffer, previous, tag), cp_.group->send(send_buffer, next, tag)};
    if (nccl) {
      Work grouped = cp_.group->endCoalescing();
      if (grouped) works = {grouped};
    }
    return std::make_unique<PostedExchange>(sent, receive_buffer.front(), std::move(works));
  }

  void all_reduce_sum(at::Tensor& x) override {
    at::NoGradGuard no_grad;
    if (size() > 1) data_parallel::all_reduce_sum(cp_, x);
  }

  std::vector<at::Tensor> all_gather(const at::Tensor& x) override {
    std::vector<at::Tensor> input{x.detach().contiguous()};
    if (size() == 1) return {input.front().clone()};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < size(); ++r) output.front().push_back(at::empty_like(input.front()));
    cp_.group->allgather(output, input)->wait();
    return output.front();
  }

 private:
  static constexpr uint64_t kTagCycle = 1u << 30;
  data_parallel::DistContext cp_;
  uint64_t exchanges_ = 0;
};

}  // namespace

std::shared_ptr<model::ContextParallelGroup> make_context_parallel_group(data_parallel::DistContext cp) {
  if (!cp.group) throw std::invalid_argument("context-parallel group: the DistContext has no process group");
  return std::make_shared<ProcessGroupContextParallel>(std::move(cp));
}

}  // namespace harness::context_parallel
