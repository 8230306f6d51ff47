// GPT-2 as Hugging Face's GPT2LMHeadModel defines it, with the same parameter names and shapes
// (transformer.wte.weight, transformer.h.0.attn.c_attn.weight stored [in, out], ...), so that
// Hugging Face weights load unchanged. Placement over several devices (model parallel) and a
// pluggable executor for the blocks (the pipeline) live here too; the pipeline itself does not.
// Given a tensor-parallel group, the same model is split Megatron's way (tensor_parallel.h):
// c_attn and c_fc are column-parallel (attention splits by heads), both c_proj row-parallel, the
// tied wte and head split over the vocabulary (vocab_parallel.h: no rank holds all the logits),
// wpe and the layer norms replicated; parameter names stay Hugging Face's, the tensors are this
// rank's shards. Given a context-parallel group (set_context_parallel), each rank holds its zigzag
// shard of every sequence (context_parallel.h): attention is ring attention over the group, the
// position embeddings are the shard's true positions, and the loss is the whole sequence's.
// With sequence parallelism on a tensor-parallel group (set_sequence_parallel), the hidden states
// between the split layers (LayerNorm, dropout, the residual stream) are split over the group too,
// by rows or along the sequence: each rank holds 1/T of those activations (Megatron's).
// Under a DeferWeightGradients scope (weight_grad_store.h), the Conv1Ds' and the tied head's
// weight gradients are left out of backward and put into a store, run later (zero-bubble's W).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "harness/device.h"
#include "harness/model/config.h"
#include "harness/model/context_parallel.h"
#include "harness/model/tensor_parallel.h"

namespace harness::model {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// How a linear layer is laid out over a tensor-parallel group (Megatron's styles).
//   kColumn: this rank holds a slice of the output features; the input is replicated (its
//            gradient is summed over the group), the output is the rank's slice.
//   kRow:    this rank holds a slice of the input features and takes the matching slice of the
//            input; the partial products are summed over the group and the (replicated) bias
//            added once after the sum.
enum class ParallelStyle { kReplicated, kColumn, kRow };

// Sequence parallelism: the dimension of [B, T, C] activations that is split over the
// tensor-parallel group between its split layers (0, the rows, or 1, the sequence), or kWhole.
constexpr int64_t kWhole = -1;

// Hugging Face's Conv1D: y = x @ weight + bias with weight stored [in_features, out_features].
// With a group and a style other than kReplicated, weight and bias are this rank's shards; the
// initial weights are drawn for the whole layer (the same draws for every group size) and sliced.
class Conv1DImpl : public torch::nn::Module {
 public:
  Conv1DImpl(int64_t in_features, int64_t out_features, ParallelStyle style = ParallelStyle::kReplicated,
             std::shared_ptr<TensorParallelGroup> tp = nullptr, int64_t fused_parts = 1);
  // split_dim (sequence parallelism, a split layer): x is this rank's part of the activations
  // along that dimension for a column-parallel layer, which gathers the whole first; a
  // row-parallel layer reduce-scatters its partial products along it, and returns this rank's
  // part.
  torch::Tensor forward(const torch::Tensor& x, int64_t split_dim = kWhole);
  // How the unsplit [in, out] weight and [out] bias are spread over the group (kReplicated
  // without one).
  ShardSpec weight_spec() const;
  ShardSpec bias_spec() const;
  torch::Tensor weight, bias;

 private:
  int64_t in_features_, out_features_;
  ParallelStyle style_;
  std::shared_ptr<TensorParallelGroup> tp_;
  int64_t fused_parts_;
};
TORCH_MODULE(Conv1D);

// Keys and values of past positions for one block, so that generation costs one position per
// new token. Both are [B, n_head, T_past, head_dim]; undefined before the first call.
struct LayerKVCache {
  torch::Tensor key, value;
};
struct KVCache {
  std::vector<LayerKVCache> layers;
  int64_t length() const;  // positions cached so far
};

// With a tensor-parallel group, this rank's n_head / T heads: c_attn holds their q, k and v
// columns (column-parallel, three fused parts), c_proj the matching rows (row-parallel); the KV
// cache holds those heads alone, and their attention-probability dropout draws from the rank's
// own stream.
class GPT2AttentionImpl : public torch::nn::Module {
 public:
  explicit GPT2AttentionImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp = nullptr);
  // With a context group and no cache, x is this rank's zigzag shard and attention is
  // ring_attention over the group (a collective); with a cache, plain attention as without one.
  // split_dim (no cache): x and the result are this rank's part of the activations along it
  // (see Conv1DImpl::forward); attention runs on the whole batch.
  torch::Tensor forward(const torch::Tensor& x, LayerKVCache* cache = nullptr, int64_t split_dim = kWhole);
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> cp) { cp_ = std::move(cp); }
  Conv1D c_attn{nullptr}, c_proj{nullptr};
  torch::nn::Dropout attn_dropout{nullptr}, resid_dropout{nullptr};

 private:
  int64_t n_head_, head_dim_;  // n_head_: the heads on this rank
  std::shared_ptr<TensorParallelGroup> tp_;
  std::shared_ptr<ContextParallelGroup> cp_;
};
TORCH_MODULE(GPT2Attention);

// With a tensor-parallel group: c_fc column-parallel, c_proj row-parallel (GELU is element-wise,
// so it applies to each rank's slice of the inner features unchanged).
class GPT2MLPImpl : public torch::nn::Module {
 public:
  explicit GPT2MLPImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp = nullptr);
  torch::Tensor forward(const torch::Tensor& x, int64_t split_dim = kWhole);
  Conv1D c_fc{nullptr}, c_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};

 private:
  std::shared_ptr<TensorParallelGroup> tp_;
};
TORCH_MODULE(GPT2MLP);

// One pre-LayerNorm transformer block. forward(x) returns the hidden states only, so a run of
// blocks is a torch::nn::Sequential (what the pipeline drives).
class GPT2BlockImpl : public torch::nn::Module {
 public:
  explicit GPT2BlockImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp = nullptr);
  torch::Tensor forward(const torch::Tensor& x);  // forward_mlp(forward_attention(x))
  // The two residual halves, x + attn(ln_1(x)) and h + mlp(ln_2(h)): a pipeline may cut a block
  // between them (and place them on two devices; forward_mlp moves h to ln_2's device).
  // split_dim: x and h are this rank's part of the activations along it over the tensor-parallel
  // group, and so are the results; the LayerNorms run on that part.
  torch::Tensor forward_attention(const torch::Tensor& x, int64_t split_dim = kWhole);
  torch::Tensor forward_mlp(const torch::Tensor& h, int64_t split_dim = kWhole);
  torch::Tensor forward_cached(const torch::Tensor& x, LayerKVCache& cache);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  GPT2Attention attn{nullptr};
  GPT2MLP mlp{nullptr};

 private:
  std::shared_ptr<TensorParallelGroup> tp_;
};
TORCH_MODULE(GPT2Block);

// With a group, wte's weight is this rank's rows of the vocabulary (vocabulary_range); the lookup
// goes through vocab_parallel_embedding (GPT2LMHeadModel::embed), not wte's own forward.
class GPT2ModelImpl : public torch::nn::Module {
 public:
  explicit GPT2ModelImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp = nullptr);
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(GPT2Model);

// Runs the blocks on hidden states [B, T, C] given on the first device and returns them on any
// device; the pipeline installs one of these (see set_blocks_executor).
using BlocksExecutor = std::function<torch::Tensor(const torch::Tensor&)>;

// One parameter of the unsplit model: how it is split and its unsplit shape.
struct ParameterShard {
  ShardSpec spec;
  std::vector<int64_t> full_shape;
};

class GPT2LMHeadModelImpl : public torch::nn::Module {
 public:
  // `tp`: the tensor-parallel group to split over (every rank of it constructs the model with
  // the same config and the same torch seed, and gets the same weights as the unsplit model's,
  // sliced); null: the whole model here. Throws when n_head or the MLP does not divide, or the
  // vocabulary has fewer ids than the group has ranks.
  explicit GPT2LMHeadModelImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp = nullptr);

  // input_ids [B, T] (int64, on the first device) -> logits [B, T, vocab_size] on the first device.
  // Split over a group, every rank passes the same input_ids and gets the same logits, gathered
  // from every rank's vocabulary slice (for inspection: training, evaluation and generation use
  // loss() and next_token(), which never build them).
  torch::Tensor forward(const torch::Tensor& input_ids);
  // Same, attending to and extending `cache` (generation); positions continue after the cache.
  torch::Tensor forward_cached(const torch::Tensor& input_ids, KVCache& cache);
  // input_ids [B, T] -> token plus position embeddings after dropout, [B, T, C] on the
  // embeddings' device, positions starting at past_length (a pipeline's first stage). With a
  // context group and past_length 0, input_ids is this rank's zigzag shard of sequences of
  // T * C positions, and each token gets its position in the whole sequence.
  torch::Tensor embed(const torch::Tensor& input_ids, int64_t past_length = 0);
  // Generation's embed: input_ids [B, T] at the positions after `cache`'s, whole (never a context
  // or sequence shard), as forward_cached embeds them: a pipeline's first stage's part of it.
  torch::Tensor embed_cached(const torch::Tensor& input_ids, const KVCache& cache);
  // Block halves [first_unit, end_unit) on hidden states [B, T, C]: unit 2i is block i's attention
  // half, x + attn(ln_1(x)), unit 2i + 1 its MLP half, h + mlp(ln_2(h)), each run where its
  // parameters are. forward() runs all of them; a pipeline stage runs its run of them. With
  // `cache`, the attention halves attend to and extend their layers' entries (generation through
  // a pipeline: each stage keeps its own layers' cache).
  torch::Tensor forward_units(torch::Tensor hidden, int64_t first_unit, int64_t end_unit, KVCache* cache = nullptr);
  int64_t n_units() const { return 2 * config_.n_layer; }
  // ln_f, then the tied head's product with `head_weight` (wte's weight, or a pipeline's copy of it
  // on the last stage) on that weight's device: logits [B, T, vocab_size] (gathered over the
  // vocabulary when split, like forward()). With embed() and forward_units() the whole of forward().
  torch::Tensor head_logits(const torch::Tensor& hidden, const torch::Tensor& head_weight);
  // SPEC §3's weighted loss from the last block's hidden states [B, T, C]: ln_f, the tied head
  // and weighted_cross_entropy against labels and weights [B, T] (moved to the head's device);
  // weight_sum as there (undefined: the weights' own sum; a micro-batch's: the whole batch's).
  // head_weight undefined: wte's. Split over a group, each rank forms its vocabulary slice of
  // the logits alone and the loss is vocab_parallel_weighted_cross_entropy's; every rank gets it.
  // With a context group, hidden, labels and weights are this rank's zigzag shard; weight_sum is
  // the whole sequences' (undefined: the shards' weights summed over the group), and the loss
  // returned is the whole sequences' on every rank (each rank's backward carries its own tokens'
  // part of the gradient, so the group's gradients sum to the whole one).
  torch::Tensor head_loss(const torch::Tensor& hidden, const torch::Tensor& labels, const torch::Tensor& weights,
                          const torch::Tensor& weight_sum = {}, const torch::Tensor& head_weight = {});
  // The greedy next token after hidden [B, T, C] (row 0, last position): the arg-max of its
  // logits over the first `vocabulary` ids (a tokenizer smaller than the head), the lowest on a
  // tie. Split: vocab_parallel_argmax over the slices; the same id on every rank.
  int64_t head_next_token(const torch::Tensor& hidden, int64_t vocabulary, const torch::Tensor& head_weight = {});
  // embed, the blocks (or the installed executor) and head_loss: the training step's and the
  // validation loss.
  torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels, const torch::Tensor& weights,
                     const torch::Tensor& weight_sum = {});
  // forward_cached's walk, then head_next_token: one step of greedy generation.
  int64_t next_token(const torch::Tensor& input_ids, KVCache& cache, int64_t vocabulary);

  const GPT2Config& config() const { return config_; }
  GPT2ModelImpl& transformer_module() { return *transformer; }

  // Context parallelism: from now on loss(), forward(), embed(), forward_units() and head_loss()
  // take this rank's zigzag shard of each sequence (zigzag_shard along dimension 1) and are
  // collectives over `cp` (every rank of it calls them in the same order); the cached path
  // (generation) stays plain attention on whole sequences. The weights are not split: every rank
  // of the group holds them all. Null restores the plain model; a group of one computes the same
  // numbers as no group, through ring attention.
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> cp);
  ContextParallelGroup* context_parallel() const { return cp_.get(); }

  // Sequence parallelism over the tensor-parallel group (Megatron's): from now on embed() returns
  // this rank's part t of the batch's tokens: rows [t B/T, (t+1) B/T) where the B rows divide by T
  // (a contiguous part, as Megatron's split of its sequence-first layout), else positions
  // [t S/T, (t+1) S/T) of each sequence (of the context shard with a context group).
  // forward_units() takes and returns such parts (the split of the last embed() or
  // split_sequences_as()), and head_loss() takes the part and gathers the whole before the head.
  // The column-parallel layers all-gather their input and the row-parallel ones reduce-scatter
  // their output; LayerNorm, dropout (from the rank's own stream) and the residual stream run on
  // the part, and the gradients of the parameters used there (the LayerNorms, the row-parallel
  // biases, wpe) are summed over the group. forward() still returns the whole logits; the cached
  // path (generation) stays whole. embed() throws, naming the flags, where neither the rows nor
  // the sequence divide by T. Throws without a tensor-parallel group of two or more ranks.
  void set_sequence_parallel(bool on);
  bool sequence_parallel() const { return sp_; }
  // With sequence parallelism, what micro-batches of rows x tokens (the tokens of this rank's
  // context shard, with a context group) are split along between the split layers: 0 where the rows
  // divide by T, else 1; kWhole without it. Throws, naming the flags, where neither divides.
  int64_t sequence_split_of(int64_t rows, int64_t tokens) const;
  // A pipeline stage that does not embed (or one about to take its next micro-batch) sets the split
  // its forward_units() and head_loss() follow, as embed() does for its own input.
  void split_sequences_as(int64_t rows, int64_t tokens) { split_dim_ = sequence_split_of(rows, tokens); }

  // Hugging Face's initialisation: normal(0, initializer_range) weights, zero biases, unit
  // LayerNorms, c_proj weights scaled by 1/sqrt(2 * n_layer). Deterministic given torch's seed.
  void reset_parameters();

  // Model parallel (SPEC §4): blocks in contiguous runs of ceil(n_layer / n_devices) per device;
  // embeddings and the tied head on the first device, ln_f on the last; parameters are moved.
  // One device means no parallelism. Throws when a device would be left without a block.
  void parallelize(const std::vector<Device>& devices);
  // Any placement (the pipeline's balances and interleaving): block i on block_devices[i] (one
  // entry per block), embeddings and the tied head with block 0, ln_f with the last block.
  void place(const std::vector<Device>& block_devices);
  // Half-block placement: block i's ln_1 and attention on attention_devices[i], its ln_2 and MLP
  // on mlp_devices[i]; embeddings with block 0's attention, ln_f with the last block's MLP.
  void place(const std::vector<Device>& attention_devices, const std::vector<Device>& mlp_devices);
  const std::vector<Device>& block_devices() const { return block_devices_; }
  Device first_device() const { return first_device_; }
  Device last_device() const { return last_device_; }

  // Replaces the sequential walk over the blocks (e.g. by a Pipe); an empty function restores it.
  void set_blocks_executor(BlocksExecutor executor) { blocks_executor_ = std::move(executor); }

  // ----- the unsplit model's view (tensor parallelism) -----
  // The group the model is split over; null when it is whole here.
  TensorParallelGroup* tensor_parallel() const { return tp_.get(); }
  // Every parameter by name: how it is split (kReplicated throughout without a group).
  const std::map<std::string, ParameterShard>& shards() const { return shards_; }
  // Parameters of the unsplit model, counting the tied head once (gpt2: 124,439,808).
  int64_t unsplit_parameter_count() const;
  // The unsplit weights (or gradients of the last backward; parameters without one left out),
  // detached, on the CPU, in named_parameters() order. Collective over the group when split;
  // without a group a CPU parameter is returned as it is (storage shared: copy before training).
  NamedTensors full_state();
  NamedTensors full_gradients();
  // The same one parameter at a time (weights, or gradients where defined), in named_parameters()
  // order: `visit` sees each unsplit tensor before the next is gathered, so none is held longer.
  void for_each_full(bool gradients, const std::function<void(const std::string&, const torch::Tensor&)>& visit);
  // Collective when split: the unsplit tensor of parameter `name` from each rank's `local`
  // (weights, or a tensor shaped like them: an optimizer moment), on the CPU.
  torch::Tensor unshard(const std::string& name, const torch::Tensor& local);
  // This rank's part of an unsplit tensor shaped like parameter `name`.
  torch::Tensor shard(const std::string& name, const torch::Tensor& full) const;
  // Unsplit weights in: every parameter once, with its unsplit shape (names with or without
  // "transformer."); each rank keeps its part. Errors name the tensor and the shapes.
  void load_full_state(const NamedTensors& full);
  // The same checks, with each rank's part of every parameter handed to `load` (in the model's
  // order, named as named_parameters() names it) instead of copied into the parameter: where the
  // parameters' storage is elsewhere (ZeRO-3's chunks).
  void load_full_state(const NamedTensors& full,
                       const std::function<void(const std::string&, const torch::Tensor&)>& load);
  // Collective: the largest absolute difference between a replicated parameter's gradient here
  // and on the group's rank 0 (0 when they agree, as they must by construction; 0 unsplit).
  double replicated_gradient_divergence();

  GPT2Model transformer{nullptr};

 private:
  // embed(): positions from past_length on, or (context_shard) the zigzag shard's positions.
  // sequence_split: this rank's part of the sequence (sequence parallelism).
  torch::Tensor embed_at(const torch::Tensor& input_ids, int64_t past_length, bool context_shard,
                         bool sequence_split);
  // loss() and forward() with sequence parallelism and a blocks executor: throws.
  void check_no_executor_with_sequence_parallel() const;
  // The last block's hidden states through the cached blocks (forward_cached, next_token).
  torch::Tensor hidden_cached(const torch::Tensor& input_ids, KVCache& cache);
  // ln_f and the tied head: the whole logits, or this rank's vocabulary slice of them when split.
  // split_dim: hidden is this rank's part along it; the head gets the whole of it.
  torch::Tensor head_slice(const torch::Tensor& hidden, const torch::Tensor& head_weight, int64_t split_dim = kWhole);

  GPT2Config config_;
  std::shared_ptr<TensorParallelGroup> tp_;
  std::shared_ptr<ContextParallelGroup> cp_;
  bool sp_ = false;
  // Sequence parallelism: what the last embed() split the hidden states along (0 where the
  // batch's rows divide by T, else 1), which forward_units and the head follow.
  int64_t split_dim_ = 1;
  std::map<std::string, ParameterShard> shards_;
  std::vector<Device> block_devices_;
  Device first_device_ = Device::cpu(0), last_device_ = Device::cpu(0);
  BlocksExecutor blocks_executor_;
};
TORCH_MODULE(GPT2LMHeadModel);

// Hugging Face's initialisation of the (unsplit) parameter `name` in place: unit LayerNorm
// weights, zero biases, normal(0, initializer_range) weights, c_proj weights scaled by
// 1/sqrt(2 * n_layer). One draw per call, so callers walking the parameters in order agree.
void init_gpt2_parameter(const std::string& name, torch::Tensor& tensor, const GPT2Config& config);

// The tied head's product hidden [..., C] @ weight^T, weight [V, C]: torch::linear, except in fp32
// on the CPU outside autocast with V not a multiple of 16, where the product runs on the weight
// padded with zero rows to the next multiple (rows of the logits aligned to cache lines; about
// 1.5x faster forward with V = 1417 or 50257) and the logits are copied out unpadded.
// Differentiable to first order in both arguments; the weight's gradient deferred under a
// DeferWeightGradients scope.
torch::Tensor vocabulary_logits(const torch::Tensor& hidden, const torch::Tensor& weight);

// Parameters, counting the tied head once (gpt2: 124,439,808).
int64_t count_parameters(torch::nn::Module& module);

}  // namespace harness::model
