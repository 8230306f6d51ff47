// model::TensorParallelGroup over a c10d process group (see group.h).
#include "harness/tensor_parallel/group.h"

#include <stdexcept>
#include <string>

#include "harness/tensor_parallel/comm_ops.h"
#include "harness/tensor_parallel/parallel_rng.h"

namespace harness::tensor_parallel {
namespace {

class ProcessGroupTensorParallel : public model::TensorParallelGroup {
 public:
  explicit ProcessGroupTensorParallel(data_parallel::DistContext tp) : tp_(std::move(tp)), rng_(tp_.rank) {}

  int rank() const override { return tp_.rank; }
  int size() const override { return tp_.world_size; }
  at::Tensor copy_to_region(const at::Tensor& x) override { return copy_to_tp_region(x, connected()); }
  at::Tensor reduce_from_region(const at::Tensor& x) override { return reduce_from_tp_region(x, connected()); }
  std::vector<at::Tensor> all_gather(const at::Tensor& x) override { return tensor_parallel::all_gather(x, connected()); }
  at::Tensor gather_sequence(const at::Tensor& x, int64_t dim) override {
    return tensor_parallel::gather_sequence(x, dim, connected());
  }
  at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim) override {
    return tensor_parallel::reduce_scatter_sequence(x, dim, connected());
  }
  at::Tensor all_reduce(const at::Tensor& x, ReduceOp op) override {
    std::vector<at::Tensor> buffers{x.detach().contiguous().clone()};
    if (tp_.world_size > 1) {
      c10d::AllreduceOptions options;
      options.reduceOp = op == ReduceOp::kSum   ? c10d::ReduceOp::SUM
                         : op == ReduceOp::kMax ? c10d::ReduceOp::MAX
                                                : c10d::ReduceOp::MIN;
      connected().group->allreduce(buffers, options)->wait();
    }
    return buffers[0];
  }
  at::Tensor run_in_rank_stream(const c10::Device& device, const std::function<at::Tensor()>& fn) override {
    return rng_.run(device, fn);
  }
  std::map<std::string, at::Tensor> rank_stream_states() const override { return rng_.states(); }
  void set_rank_stream_states(const std::map<std::string, at::Tensor>& states) override { rng_.set_states(states); }
  void reconnect(data_parallel::DistContext tp) {
    if (!tp.group || tp.rank != tp_.rank || tp.world_size != tp_.world_size) {
      throw std::invalid_argument("reconnect_tensor_parallel_group: rank " + std::to_string(tp.rank) + " of " +
                                  std::to_string(tp.world_size) + " for the group's rank " + std::to_string(tp_.rank) +
                                  " of " + std::to_string(tp_.world_size));
    }
    tp_ = std::move(tp);
  }

 private:
  const data_parallel::DistContext& connected() const {
    if (!tp_.group) throw std::logic_error("tensor-parallel GPT-2: the group is not connected yet");
    return tp_;
  }

  data_parallel::DistContext tp_;
  ParallelRegionRng rng_;
};

}  // namespace

void reconnect_tensor_parallel_group(model::TensorParallelGroup& group, data_parallel::DistContext tp) {
  auto* ours = dynamic_cast<ProcessGroupTensorParallel*>(&group);
  if (ours == nullptr) throw std::invalid_argument("reconnect_tensor_parallel_group: not a process group's");
  ours->reconnect(std::move(tp));
}

std::shared_ptr<model::TensorParallelGroup> make_tensor_parallel_group(data_parallel::DistContext tp) {
  if (!tp.group) throw std::invalid_argument("tensor-parallel GPT-2: no tensor-parallel process group");
  return std::make_shared<ProcessGroupTensorParallel>(std::move(tp));
}

std::shared_ptr<model::TensorParallelGroup> make_unconnected_tensor_parallel_group(int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument("tensor-parallel GPT-2: rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  data_parallel::DistContext tp;
  tp.rank = rank;
  tp.world_size = size;
  return std::make_shared<ProcessGroupTensorParallel>(std::move(tp));
}

}  // namespace harness::tensor_parallel
