// NaiveAllReduce and average_gradients (see grad_sync.h).
#include "harness/data_parallel/grad_sync.h"

#include <torch/torch.h>

#include <stdexcept>

#include "harness/data_parallel/bucketed_all_reduce.h"

namespace harness::data_parallel {
namespace {

void average_in_place(const DistContext& ctx, const std::vector<at::Tensor>& parameters,
                      AllReduceAlgorithm allreduce) {
  torch::NoGradGuard no_grad;
  for (const auto& parameter : parameters) {
    at::Tensor grad = parameter.mutable_grad();
    if (!grad.defined()) continue;
    all_reduce(ctx, grad, allreduce, ReduceKind::kMean);
  }
}

}  // namespace

NaiveAllReduce::NaiveAllReduce(DistContext ctx, AllReduceAlgorithm allreduce)
    : ctx_(std::move(ctx)), allreduce_(allreduce) {}

void NaiveAllReduce::attach(std::vector<at::Tensor> parameters) {
  parameters_ = std::move(parameters);
}

void NaiveAllReduce::finalize() { average_in_place(ctx_, parameters_, allreduce_); }

void average_gradients(torch::nn::Module& module, const DistContext& ctx) {
  average_in_place(ctx, module.parameters(/*recurse=*/true), AllReduceAlgorithm::kBuiltin);
}

std::unique_ptr<GradientSynchronizer> make_gradient_synchronizer(const std::string& kind,
                                                                 const DistContext& ctx,
                                                                 double bucket_cap_mb,
                                                                 AllReduceAlgorithm allreduce) {
  if (kind == "naive") return std::make_unique<NaiveAllReduce>(ctx, allreduce);
  if (kind == "bucketed") return std::make_unique<BucketedAllReduce>(ctx, bucket_cap_mb, allreduce);
  throw std::invalid_argument("--grad_sync " + kind + " is unknown: use naive or bucketed");
}

}  // namespace harness::data_parallel
