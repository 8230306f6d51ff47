// GPT-2 split over a tensor-parallel group, Megatron style: in every block the MLP's c_fc is
// column-parallel and its c_proj row-parallel; attention splits the heads (c_attn's q, k and v
// columns of this rank's heads, c_proj row-parallel). Embeddings, LayerNorms and the tied head are
// replicated. Parameter names are Hugging Face's; the tensors are this rank's shards, and the
// model loads and saves the same unsplit weights as model::GPT2LMHeadModel.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/model/config.h"
#include "harness/model/gpt2.h"
#include "harness/model/safetensors.h"
#include "harness/tensor_parallel/layers.h"
#include "harness/tensor_parallel/parallel_rng.h"

namespace harness::tensor_parallel {

// Throws std::invalid_argument with the numbers when n_head or the MLP's inner size is not
// divisible by tensor_parallel_size (or the config itself is invalid).
void validate_tensor_parallel(const model::GPT2Config& config, int tensor_parallel_size);

class TensorParallelGPT2AttentionImpl : public torch::nn::Module {
 public:
  // Attention dropout draws from `rng` (a stream per rank; see parallel_rng.h); null: its own.
  TensorParallelGPT2AttentionImpl(const model::GPT2Config& config, data_parallel::DistContext tp,
                                  std::shared_ptr<ParallelRegionRng> rng = nullptr);
  at::Tensor forward(const at::Tensor& x);  // [B, T, C] replicated -> [B, T, C] replicated
  ColumnParallelLinear c_attn{nullptr};     // [C, 3C / T]: this rank's q | k | v head columns
  RowParallelLinear c_proj{nullptr};        // [C / T, C]
  torch::nn::Dropout attn_dropout{nullptr}, resid_dropout{nullptr};

 private:
  int64_t local_heads_, head_dim_;
  std::shared_ptr<ParallelRegionRng> rng_;
};
TORCH_MODULE(TensorParallelGPT2Attention);

class TensorParallelGPT2MLPImpl : public torch::nn::Module {
 public:
  TensorParallelGPT2MLPImpl(const model::GPT2Config& config, data_parallel::DistContext tp);
  at::Tensor forward(const at::Tensor& x);
  ColumnParallelLinear c_fc{nullptr};  // [C, inner / T]
  RowParallelLinear c_proj{nullptr};   // [inner / T, C]
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(TensorParallelGPT2MLP);

class TensorParallelGPT2BlockImpl : public torch::nn::Module {
 public:
  TensorParallelGPT2BlockImpl(const model::GPT2Config& config, data_parallel::DistContext tp,
                              std::shared_ptr<ParallelRegionRng> rng = nullptr);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  TensorParallelGPT2Attention attn{nullptr};
  TensorParallelGPT2MLP mlp{nullptr};
};
TORCH_MODULE(TensorParallelGPT2Block);

class TensorParallelGPT2ModelImpl : public torch::nn::Module {
 public:
  TensorParallelGPT2ModelImpl(const model::GPT2Config& config, data_parallel::DistContext tp,
                              std::shared_ptr<ParallelRegionRng> rng = nullptr);
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  // The attention-dropout stream all blocks share (checkpoints save and restore it).
  ParallelRegionRng& rng() { return *rng_; }

 private:
  std::shared_ptr<ParallelRegionRng> rng_;
};
TORCH_MODULE(TensorParallelGPT2Model);

// One parameter as the unsplit model has it: its name, shape and how it is split.
struct ParameterShard {
  ShardSpec spec;
  std::vector<int64_t> full_shape;
};

class TensorParallelGPT2LMHeadModelImpl : public torch::nn::Module {
 public:
  // Every rank of `tp` must construct it with the same config and the same torch seed: the
  // weights are Hugging Face's initialisation of one unsplit model, each rank keeping its shard.
  TensorParallelGPT2LMHeadModelImpl(const model::GPT2Config& config, data_parallel::DistContext tp);

  // input_ids [B, T] (the same on every rank of the group) -> logits [B, T, vocab] (replicated).
  at::Tensor forward(const at::Tensor& input_ids);

  const model::GPT2Config& config() const { return config_; }
  const data_parallel::DistContext& tensor_context() const { return tp_; }
  // Name (Hugging Face's) -> split and unsplit shape, for every parameter.
  const std::map<std::string, ParameterShard>& shards() const { return shards_; }

  void reset_parameters();

  // Unsplit weights in: every parameter must be given once with its unsplit shape (names with or
  // without "transformer."); each rank keeps its shard. Errors name the tensor and the shapes.
  void load_full_state(const model::NamedTensors& full);
  void load_from(model::GPT2LMHeadModelImpl& full);

  // Collective over the tensor-parallel group (every rank calls it): the unsplit weights, in
  // named_parameters() order, on the CPU.
  model::NamedTensors gather_full_state();
  // The same for the gradients; parameters without a gradient are left out.
  model::NamedTensors gather_full_gradients();
  // Collective: copies the unsplit weights into `full` (same config), e.g. to evaluate or generate.
  void copy_into(model::GPT2LMHeadModelImpl& full);
  // Collective: the largest absolute difference between a replicated parameter's gradient here
  // and on the group's rank 0 (0 when they agree, as they should by construction).
  double replicated_gradient_divergence();

  TensorParallelGPT2Model transformer{nullptr};

 private:
  at::Tensor embed(const at::Tensor& input_ids);
  model::NamedTensors gather(bool gradients);

  model::GPT2Config config_;
  data_parallel::DistContext tp_;
  std::map<std::string, ParameterShard> shards_;
};
TORCH_MODULE(TensorParallelGPT2LMHeadModel);

// dir/model.safetensors (validated as model::load_pretrained does) into the split model.
void load_pretrained(TensorParallelGPT2LMHeadModelImpl& model, const std::string& dir);
// Collective: gathers the unsplit weights; the group's rank 0 writes dir/config.json and
// dir/model.safetensors exactly as model::save_pretrained would for the unsplit model.
void save_pretrained(TensorParallelGPT2LMHeadModelImpl& model, const std::string& dir);

}  // namespace harness::tensor_parallel
