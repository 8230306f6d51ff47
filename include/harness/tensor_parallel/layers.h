// Megatron-style parallel linear layers, with weights in Hugging Face's Conv1D layout
// [in_features, out_features] (y = x @ weight + bias) so that GPT-2's c_attn/c_fc/c_proj split
// directly. A torch::nn::Linear weight is the transpose ([out, in]).
//
// ColumnParallelLinear: rank t holds the columns (output features) of its shard; the input is
// replicated (copy_to_tp_region: its gradient is all-reduced), the output is the rank's slice of
// the features, or the whole output with gather_output.
// RowParallelLinear: rank t holds the rows (input features) of its shard; the input is the rank's
// slice of the features (or sliced here without input_is_parallel), the partial products are
// all-reduced and the bias, replicated, is added once after the reduction.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <vector>

#include "harness/data_parallel/process_group.h"

namespace harness::tensor_parallel {

// How a parameter of the unsplit model is spread over the tensor-parallel ranks.
struct ShardSpec {
  enum class Kind { kReplicated, kColumns, kRows };
  Kind kind = Kind::kReplicated;
  // kColumns: the output dimension is `fused_parts` equal blocks fused side by side (GPT-2's
  // c_attn packs [q | k | v]: 3); each block is split over the ranks on its own, so rank t holds
  // block p's t-th slice for every p, in block order.
  int64_t fused_parts = 1;
  // The dimension that is split: kColumns the last one, kRows the first; none for kReplicated.
  int64_t split_dim(const at::Tensor& full) const;
};

// Rank `rank`'s shard of an unsplit tensor, and the unsplit tensor from every rank's shard
// (pure). Errors name the shape, the split and the number of ranks when they do not divide.
at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int rank, int world_size);
at::Tensor unshard_tensor(const std::vector<at::Tensor>& shards, const ShardSpec& spec);

struct ColumnParallelLinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;  // unsplit; must be divisible by tp size * fused_parts
  bool bias = true;
  bool gather_output = false;
  int64_t fused_parts = 1;
};

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options, data_parallel::DistContext tp);
  // x [..., in] replicated -> [..., out / T] (this rank's features) or [..., out] (gather_output).
  at::Tensor forward(const at::Tensor& x);

  // Takes this rank's shard of an unsplit [in, out] weight and [out] bias (copied, no autograd).
  void load_full(const at::Tensor& weight, const at::Tensor& bias);
  ShardSpec weight_spec() const { return {ShardSpec::Kind::kColumns, options_.fused_parts}; }
  ShardSpec bias_spec() const { return weight_spec(); }
  const ColumnParallelLinearOptions& options() const { return options_; }

  at::Tensor weight, bias;  // [in, out / T], [out / T]

 private:
  ColumnParallelLinearOptions options_;
  data_parallel::DistContext tp_;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  int64_t in_features = 0;  // unsplit; must be divisible by tp size
  int64_t out_features = 0;
  bool bias = true;
  bool input_is_parallel = true;
};

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(const RowParallelLinearOptions& options, data_parallel::DistContext tp);
  // x [..., in / T] (input_is_parallel) or [..., in] replicated -> [..., out] replicated.
  at::Tensor forward(const at::Tensor& x);

  void load_full(const at::Tensor& weight, const at::Tensor& bias);
  ShardSpec weight_spec() const { return {ShardSpec::Kind::kRows, 1}; }
  ShardSpec bias_spec() const { return {ShardSpec::Kind::kReplicated, 1}; }
  const RowParallelLinearOptions& options() const { return options_; }

  at::Tensor weight, bias;  // [in / T, out], [out]

 private:
  RowParallelLinearOptions options_;
  data_parallel::DistContext tp_;
};
TORCH_MODULE(RowParallelLinear);

}  // namespace harness::tensor_parallel
