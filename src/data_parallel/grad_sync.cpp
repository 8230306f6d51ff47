// NaiveAllReduce and average_gradients (see grad_sync.h).
#include "harness/data_parallel/grad_sync.h"

#include <torch/torch.h>

#include <stdexcept>

#include "harness/data_parallel/bucketed_all_reduce.h"

namespace harness::data_parallel {
namespace {

// Which parameters have a gradient is each rank's own finding (a branch one rank's batch did not
// take leaves none there); a MAX all-reduce of one flag per parameter agrees on it first, as DDP's
// find_unused_parameters does, so that every rank issues the same all-reduces: a parameter with
// a gradient on any rank is averaged on all, a rank without one contributing zeros.
// Returns the bytes this rank put into the all-reduces. With `reduce_dtype`, each gradient goes
// through the all-reduce in that dtype.
int64_t average_in_place(const DistContext& ctx, const std::vector<at::Tensor>& parameters,
                         AllReduceAlgorithm allreduce, std::optional<at::ScalarType> reduce_dtype = std::nullopt) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(ctx.group, "average_gradients: the DistContext has no process group");
  at::Tensor has_grad = torch::zeros({static_cast<int64_t>(parameters.size())}, torch::kInt);
  {
    auto flags = has_grad.accessor<int, 1>();
    for (size_t i = 0; i < parameters.size(); ++i) flags[static_cast<int64_t>(i)] = parameters[i].grad().defined();
  }
  std::vector<at::Tensor> agreement{has_grad.to(ctx.device.torch_device())};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  ctx.group->allreduce(agreement, max)->wait();
  int64_t bytes = has_grad.numel() * static_cast<int64_t>(has_grad.element_size());
  has_grad = agreement[0].to(torch::kCPU);
  const auto agreed = has_grad.accessor<int, 1>();
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (agreed[static_cast<int64_t>(i)] == 0) continue;
    at::Tensor parameter = parameters[i];
    at::Tensor& grad = parameter.mutable_grad();
    if (!grad.defined()) grad = torch::zeros_like(parameter);
    if (reduce_dtype && *reduce_dtype != grad.scalar_type()) {
      at::Tensor wire = grad.to(*reduce_dtype);
      all_reduce(ctx, wire, allreduce, ReduceKind::kSum);
      grad.copy_(wire).div_(static_cast<double>(ctx.world_size));  // the mean in the gradient's dtype
      bytes += wire.numel() * static_cast<int64_t>(wire.element_size());
      continue;
    }
    all_reduce(ctx, grad, allreduce, ReduceKind::kMean);
    bytes += grad.numel() * static_cast<int64_t>(grad.element_size());
  }
  return bytes;
}

}  // namespace

NaiveAllReduce::NaiveAllReduce(DistContext ctx, AllReduceAlgorithm allreduce)
    : ctx_(std::move(ctx)), allreduce_(allreduce) {}

void NaiveAllReduce::attach(std::vector<at::Tensor> parameters) {
  parameters_ = std::move(parameters);
}

void NaiveAllReduce::finalize() {
  communicated_bytes_ += average_in_place(ctx_, parameters_, allreduce_, reduce_dtype_);
  ++finalized_steps_;
}

void average_gradients(torch::nn::Module& module, const DistContext& ctx) {
  average_in_place(ctx, module.parameters(/*recurse=*/true), AllReduceAlgorithm::kBuiltin);
}

GradientSyncKind parse_gradient_sync(const std::string& name) {
  if (name == "naive") return GradientSyncKind::kNaive;
  if (name == "bucketed") return GradientSyncKind::kBucketed;
  throw std::invalid_argument("--grad_sync " + name + " is unknown: use naive or bucketed");
}

std::string to_string(GradientSyncKind kind) { return kind == GradientSyncKind::kNaive ? "naive" : "bucketed"; }

std::unique_ptr<GradientSynchronizer> make_gradient_synchronizer(GradientSyncKind kind, const DistContext& ctx,
                                                                 double bucket_cap_mb, AllReduceAlgorithm allreduce) {
  if (kind == GradientSyncKind::kNaive) return std::make_unique<NaiveAllReduce>(ctx, allreduce);
  return std::make_unique<BucketedAllReduce>(ctx, bucket_cap_mb, allreduce);
}

}  // namespace harness::data_parallel
