// GPT-2 modules with Hugging Face's numerics and parameter names, KV-cached generation, and
// placement of the blocks over several devices (model parallel).
#include "harness/model/gpt2.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "harness/model/dropout.h"
#include "harness/model/gelu.h"
#include "harness/model/loss.h"
#include "harness/model/vocab_parallel.h"
#include "harness/model/weight_grad_store.h"
#include "shape_text.h"

namespace harness::model {
namespace {

torch::nn::LayerNorm make_layer_norm(const GPT2Config& config) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({config.n_embd}).eps(config.layer_norm_epsilon));
}

// vocabulary_logits' padded product (see gpt2.h): with V rounded up to a multiple of 16, every
// row of the logits starts on a 64-byte cache line. With IWSLT's 1417 words (2048 x 256 tokens)
// the forward product took 27 ms unpadded and 17 ms padded, its copy to [.., V] included; with
// GPT-2's 50257 (512 x 768), 611 and 510 ms.
// The backward's two products take the unpadded weight and gradient (as fast either way).
class PaddedVocabularyProjection : public torch::autograd::Function<PaddedVocabularyProjection> {
 public:
  static constexpr int64_t kRowFloats = 16;

  static bool applies(const torch::Tensor& hidden, const torch::Tensor& weight) {
    return hidden.is_cpu() && weight.is_cpu() && hidden.scalar_type() == torch::kFloat &&
           weight.scalar_type() == torch::kFloat && weight.dim() == 2 && weight.size(0) % kRowFloats != 0 &&
           !at::autocast::is_autocast_enabled(at::kCPU);
  }

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight) {
    ctx->save_for_backward({hidden, weight});
    const int64_t V = weight.size(0), C = weight.size(1);
    const int64_t padded = (V + kRowFloats - 1) / kRowFloats * kRowFloats;
    torch::Tensor padded_weight = torch::empty({padded, C}, weight.options());
    padded_weight.narrow(0, 0, V).copy_(weight);
    padded_weight.narrow(0, V, padded - V).zero_();  // only the padding: at 124M the weight is 154 MB
    auto out_sizes = hidden.sizes().vec();
    out_sizes.back() = V;
    return torch::mm(hidden.reshape({-1, C}), padded_weight.t()).narrow(1, 0, V).contiguous().view(out_sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& hidden = saved[0];
    const torch::Tensor& weight = saved[1];
    const torch::Tensor grad = grads[0].reshape({-1, weight.size(0)});
    const torch::Tensor rows = hidden.reshape({-1, weight.size(1)});
    torch::Tensor d_hidden, d_weight;
    if (ctx->needs_input_grad(0)) d_hidden = torch::mm(grad, weight).view(hidden.sizes());
    if (ctx->needs_input_grad(1)) d_weight = torch::mm(grad.t(), rows);
    return {d_hidden, d_weight};
  }
};

// ----- deferred weight gradients (weight_grad_store.h) -----

// The store a product on `weight` defers to, or nullptr for today's joint backward: deferral
// needs grad mode, a leaf weight that wants its gradient (only a leaf's .grad can take it later)
// and an input that wants its own (B's work, and what gives the product a node to hook).
WeightGradStore* deferring_store(const torch::Tensor& input, const torch::Tensor& weight) {
  WeightGradStore* store = deferred_weight_gradients();
  if (store == nullptr || !torch::GradMode::is_enabled() || !weight.requires_grad() || !weight.is_leaf() ||
      !input.requires_grad()) {
    return nullptr;
  }
  return store;
}

// `t` as autocast hands it to a matmul on its device (cast to the autocast dtype, through
// autocast's cache for a weight), or `t` itself outside autocast. A deferred product casts its
// operands itself so that its hook holds the very input the joint backward would have saved;
// the matmul's own autocast then finds them cast and leaves them alone.
torch::Tensor autocast_operand(const torch::Tensor& t) {
  const c10::DeviceType type = t.device().type();
  if (!at::autocast::is_autocast_available(type) || !at::autocast::is_autocast_enabled(type)) return t;
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(type), t, type);
}

// mm_mat2_backward of PyTorch's torch/csrc/autograd/FunctionsManual.cpp (not exported): the
// gradient of mat2 in mat1 @ mat2, given mat2's sizes and strides as the product saw them. A
// column-major mat2 (the head's weight.t()) gets its gradient column-major, as there.
torch::Tensor mat2_gradient(const torch::Tensor& grad, const torch::Tensor& mat1, c10::IntArrayRef mat2_sizes,
                            c10::IntArrayRef mat2_strides) {
  if (mat2_strides[0] == 1 && mat2_strides[1] == mat2_sizes[0]) return grad.t().mm(mat1).t();
  return mat1.t().mm(grad);
}

// Hooks `product` = mat1 @ mat2 (+ bias), where mat2 is `weight` detached (and, with
// `transposed`, transposed): when backward reaches the product, mat2's gradient, which the joint
// graph would have computed there and passed back to `weight`, goes into `store` instead. The
// hook keeps mat1 without its graph, so that between B and W the store holds the input and the
// output gradient alone, as zero-bubble schedules do.
void defer_mat2_gradient(torch::Tensor& product, WeightGradStore* store, const torch::Tensor& weight,
                         const torch::Tensor& mat1, const torch::Tensor& mat2, bool transposed) {
  product.register_hook([store, weight, mat1 = mat1.detach(), sizes = mat2.sizes().vec(),
                         strides = mat2.strides().vec(), transposed](const torch::Tensor& grad) {
    if (!grad.defined()) return;
    store->put(weight, [grad, mat1, sizes, strides, transposed] {
      const torch::Tensor d_mat2 = mat2_gradient(grad, mat1, sizes, strides);
      return transposed ? d_mat2.t() : d_mat2;
    });
  });
}

// Conv1D's product on rows x2d: bias + x2d @ weight (torch::addmm), or x2d @ weight (torch::mm)
// without a bias, with the weight's gradient deferred under a store.
torch::Tensor conv1d_product(const torch::Tensor& bias, const torch::Tensor& x2d, const torch::Tensor& weight) {
  WeightGradStore* store = deferring_store(x2d, weight);
  if (store == nullptr) return bias.defined() ? torch::addmm(bias, x2d, weight) : torch::mm(x2d, weight);
  const torch::Tensor rows = autocast_operand(x2d);
  const torch::Tensor mat2 = autocast_operand(weight).detach();
  torch::Tensor product = bias.defined() ? torch::addmm(bias, rows, mat2) : torch::mm(rows, mat2);
  defer_mat2_gradient(product, store, weight, rows, mat2, /*transposed=*/false);
  return product;
}

// The whole sequences' loss from each context rank's part of it: the sum over the group forward;
// backward, each rank's part gets the loss's gradient unchanged (d total / d part = 1), so each
// rank's backward carries its own tokens' share of the gradient.
class ContextSum : public torch::autograd::Function<ContextSum> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& part,
                               ContextParallelGroup* group) {
    torch::Tensor total = part.detach().clone();
    group->all_reduce_sum(total);
    return total;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

// LayerNorm on x; `split_over` set (sequence parallelism), x is one rank's part of the tokens, so
// the weight's and bias's gradients are partial: copy_to_region sums them over the group.
torch::Tensor layer_norm(torch::nn::LayerNorm& ln, const torch::Tensor& x, TensorParallelGroup* split_over) {
  if (split_over == nullptr) return ln(x);
  return torch::layer_norm(x, ln->options.normalized_shape(), split_over->copy_to_region(ln->weight),
                           split_over->copy_to_region(ln->bias), ln->options.eps());
}

// Dropout on x; `split_over` set, x is one rank's part of the tokens, and its mask comes from the
// rank's own stream (the parts are different tokens), the default generator left in step.
torch::Tensor split_dropout(const torch::Tensor& x, torch::nn::Dropout& module, TensorParallelGroup* split_over) {
  if (split_over == nullptr || !module->is_training() || module->options.p() == 0.0) return model::dropout(x, module);
  return split_over->run_in_rank_stream(x.device(), [&] { return model::dropout(x, module); });
}

}  // namespace

// ----- Conv1D -------------------------------------------------------------------------------

Conv1DImpl::Conv1DImpl(int64_t in_features, int64_t out_features, ParallelStyle style,
                       std::shared_ptr<TensorParallelGroup> tp, int64_t fused_parts)
    : in_features_(in_features),
      out_features_(out_features),
      style_(tp ? style : ParallelStyle::kReplicated),
      tp_(std::move(tp)),
      fused_parts_(fused_parts) {
  // Drawn whole, then sliced: every group size consumes the same random numbers.
  torch::Tensor full_weight = torch::empty({in_features, out_features}).normal_(0, 0.02);
  torch::Tensor full_bias = torch::zeros({out_features});
  if (tp_) {
    full_weight = shard_tensor(full_weight, weight_spec(), tp_->rank(), tp_->size()).clone();
    full_bias = shard_tensor(full_bias, bias_spec(), tp_->rank(), tp_->size()).clone();
  }
  weight = register_parameter("weight", full_weight);
  bias = register_parameter("bias", full_bias);
}

ShardSpec Conv1DImpl::weight_spec() const {
  switch (style_) {
    case ParallelStyle::kColumn: return {ShardSpec::Kind::kColumns, fused_parts_};
    case ParallelStyle::kRow: return {ShardSpec::Kind::kRows, 1};
    case ParallelStyle::kReplicated: break;
  }
  return {};
}

ShardSpec Conv1DImpl::bias_spec() const {
  return style_ == ParallelStyle::kColumn ? weight_spec() : ShardSpec{};
}

torch::Tensor Conv1DImpl::forward(const torch::Tensor& x, int64_t split_dim) {
  const bool sequence_split = split_dim >= 0 && style_ != ParallelStyle::kReplicated;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = weight.size(1);
  if (style_ == ParallelStyle::kRow) {
    if (x.size(-1) != weight.size(0)) {
      throw std::invalid_argument("row-parallel Conv1D: input slice has " + std::to_string(x.size(-1)) +
                                  " features (shape " + shape_str(x.sizes()) + "), expected " +
                                  std::to_string(weight.size(0)) + " (in_features " + std::to_string(in_features_) +
                                  " / " + std::to_string(tp_->size()) + " ranks)");
    }
    const torch::Tensor partial = conv1d_product({}, x.reshape({-1, x.size(-1)}), weight).view(out_sizes);
    if (sequence_split) {  // the bias on this rank's part alone: its gradient summed over the group
      return tp_->reduce_scatter_sequence(partial, split_dim) + tp_->copy_to_region(bias);
    }
    return tp_->reduce_from_region(partial) + bias;  // the bias once, after the sum
  }
  if (style_ == ParallelStyle::kReplicated) {
    return conv1d_product(bias, x.reshape({-1, x.size(-1)}), weight).view(out_sizes);
  }
  const torch::Tensor in = sequence_split ? tp_->gather_sequence(x, split_dim) : tp_->copy_to_region(x);
  out_sizes = in.sizes().vec();
  out_sizes.back() = weight.size(1);
  return conv1d_product(bias, in.reshape({-1, in.size(-1)}), weight).view(out_sizes);
}

// ----- KV cache -----------------------------------------------------------------------------

int64_t KVCache::length() const {
  if (layers.empty() || !layers.front().key.defined()) return 0;
  return layers.front().key.size(2);
}

// ----- attention ----------------------------------------------------------------------------

GPT2AttentionImpl::GPT2AttentionImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp)
    : n_head_(config.n_head / (tp ? tp->size() : 1)), head_dim_(config.head_dim()), tp_(tp) {
  c_attn = register_module("c_attn", Conv1D(config.n_embd, 3 * config.n_embd, ParallelStyle::kColumn, tp,
                                            /*fused_parts=*/3));
  c_proj = register_module("c_proj", Conv1D(config.n_embd, config.n_embd, ParallelStyle::kRow, tp));
  attn_dropout = register_module("attn_dropout", torch::nn::Dropout(config.attn_pdrop));
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(config.resid_pdrop));
}

torch::Tensor GPT2AttentionImpl::forward(const torch::Tensor& x, LayerKVCache* cache, int64_t split_dim) {
  if (!tp_ || cache != nullptr) split_dim = kWhole;
  const int64_t C = n_head_ * head_dim_;  // this rank's heads (all of them without a group)
  const torch::Tensor fused = c_attn->forward(x, split_dim);  // the whole batch
  const int64_t B = fused.size(0), T = fused.size(1);
  auto qkv = fused.split(C, /*dim=*/2);
  auto heads = [&](const torch::Tensor& t) {  // [B, T, C] -> [B, n_head, T, head_dim]
    return t.view({B, T, n_head_, head_dim_}).transpose(1, 2);
  };
  torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);

  int64_t past = 0;
  if (cache != nullptr) {
    if (cache->key.defined()) {
      past = cache->key.size(2);
      k = torch::cat({cache->key, k}, 2);
      v = torch::cat({cache->value, v}, 2);
    }
    cache->key = k;
    cache->value = v;
  }
  const int64_t S = past + T;

  // Query i sits at absolute position past + i and sees keys 0..past + i. Without a cache the
  // mask is the plain lower triangle; a single new token sees every key.
  std::optional<torch::Tensor> mask;
  bool is_causal = false;
  if (past == 0) {
    is_causal = T > 1;
  } else if (T > 1) {
    mask = torch::ones({T, S}, torch::TensorOptions().dtype(torch::kBool).device(x.device()))
               .tril(/*diagonal=*/past);
  }
  const double dropout_p = attn_dropout->is_training() ? attn_dropout->options.p() : 0.0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  const bool ring = cp_ && cache == nullptr;
  auto attend = [&] {
    std::optional<at::Generator> generator = dropout_p > 0.0 ? mask_generator(x.device()) : std::nullopt;
    if (ring) return ring_attention(q, k, v, *cp_, scale, dropout_p, generator);
    return generator ? attention_with_dropout(q, k, v, mask, is_causal, dropout_p, scale, *generator)
                     : at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale);
  };
  // Split over a group, these heads' probabilities exist on this rank alone: their mask comes
  // from the rank's own stream, leaving the default generator in step with the other ranks.
  auto y = tp_ && dropout_p > 0.0 ? tp_->run_in_rank_stream(x.device(), attend) : attend();
  y = y.transpose(1, 2).reshape({B, T, C});
  return split_dropout(c_proj->forward(y, split_dim), resid_dropout, split_dim >= 0 ? tp_.get() : nullptr);
}

// ----- MLP and block ------------------------------------------------------------------------

GPT2MLPImpl::GPT2MLPImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp) : tp_(tp) {
  c_fc = register_module("c_fc", Conv1D(config.n_embd, config.inner_dim(), ParallelStyle::kColumn, tp));
  c_proj = register_module("c_proj", Conv1D(config.inner_dim(), config.n_embd, ParallelStyle::kRow, tp));
  dropout = register_module("dropout", torch::nn::Dropout(config.resid_pdrop));
}

torch::Tensor GPT2MLPImpl::forward(const torch::Tensor& x, int64_t split_dim) {
  if (!tp_) split_dim = kWhole;
  // Hugging Face's "gelu_new" is the tanh approximation.
  const torch::Tensor inner = gelu_tanh(c_fc->forward(x, split_dim));
  return split_dropout(c_proj->forward(inner, split_dim), dropout, split_dim >= 0 ? tp_.get() : nullptr);
}

GPT2BlockImpl::GPT2BlockImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp) : tp_(tp) {
  ln_1 = register_module("ln_1", make_layer_norm(config));
  attn = register_module("attn", GPT2Attention(config, tp));
  ln_2 = register_module("ln_2", make_layer_norm(config));
  mlp = register_module("mlp", GPT2MLP(config, tp));
}

torch::Tensor GPT2BlockImpl::forward(const torch::Tensor& x) { return forward_mlp(forward_attention(x)); }

torch::Tensor GPT2BlockImpl::forward_attention(const torch::Tensor& x, int64_t split_dim) {
  TensorParallelGroup* split_over = split_dim >= 0 ? tp_.get() : nullptr;
  return x + attn->forward(layer_norm(ln_1, x, split_over), nullptr, split_over ? split_dim : kWhole);
}

torch::Tensor GPT2BlockImpl::forward_mlp(const torch::Tensor& h, int64_t split_dim) {
  TensorParallelGroup* split_over = split_dim >= 0 ? tp_.get() : nullptr;
  const torch::Tensor here = h.to(ln_2->weight.device());  // the halves may sit on two devices
  return here + mlp->forward(layer_norm(ln_2, here, split_over), split_over ? split_dim : kWhole);
}

torch::Tensor GPT2BlockImpl::forward_cached(const torch::Tensor& x, LayerKVCache& cache) {
  return forward_mlp(x + attn->forward(ln_1(x), &cache));
}

// ----- the transformer and the LM head ------------------------------------------------------

GPT2ModelImpl::GPT2ModelImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp) {
  wte = register_module("wte", torch::nn::Embedding(config.vocab_size, config.n_embd));
  if (tp) {
    // Drawn whole, then sliced over the vocabulary (as Conv1D's weights): every group size
    // consumes the same random numbers.
    torch::NoGradGuard no_grad;
    const ShardSpec rows{ShardSpec::Kind::kBalancedRows, 1};
    wte->weight.set_data(shard_tensor(wte->weight, rows, tp->rank(), tp->size()).clone());
  }
  wpe = register_module("wpe", torch::nn::Embedding(config.n_positions, config.n_embd));
  drop = register_module("drop", torch::nn::Dropout(config.embd_pdrop));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer; ++i) h->push_back(GPT2Block(config, tp));
  ln_f = register_module("ln_f", make_layer_norm(config));
}

GPT2LMHeadModelImpl::GPT2LMHeadModelImpl(const GPT2Config& config, std::shared_ptr<TensorParallelGroup> tp)
    : config_(config), tp_(std::move(tp)) {
  validate_tensor_parallel(config_, tp_ ? tp_->size() : 1);
  transformer = register_module("transformer", GPT2Model(config_, tp_));
  block_devices_.assign(static_cast<size_t>(config_.n_layer), Device::cpu(0));
  for (const auto& item : named_parameters()) shards_[item.key()] = {ShardSpec{}, item.value().sizes().vec()};
  auto record = [&](const std::string& prefix, const Conv1D& layer, int64_t in, int64_t out) {
    shards_[prefix + ".weight"] = {layer->weight_spec(), {in, out}};
    shards_[prefix + ".bias"] = {layer->bias_spec(), {out}};
  };
  const int64_t C = config_.n_embd, inner = config_.inner_dim();
  if (tp_) shards_["transformer.wte.weight"] = {{ShardSpec::Kind::kBalancedRows, 1}, {config_.vocab_size, C}};
  for (size_t i = 0; i < transformer->h->size(); ++i) {
    auto block = transformer->h->ptr<GPT2BlockImpl>(i);
    const std::string prefix = "transformer.h." + std::to_string(i);
    record(prefix + ".attn.c_attn", block->attn->c_attn, C, 3 * C);
    record(prefix + ".attn.c_proj", block->attn->c_proj, C, C);
    record(prefix + ".mlp.c_fc", block->mlp->c_fc, C, inner);
    record(prefix + ".mlp.c_proj", block->mlp->c_proj, inner, C);
  }
  reset_parameters();
}

void init_gpt2_parameter(const std::string& name, torch::Tensor& tensor, const GPT2Config& config) {
  torch::NoGradGuard no_grad;
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const double std = config.initializer_range;
  const bool layer_norm = name.find(".ln_") != std::string::npos;
  if (layer_norm && ends_with(".weight")) {
    tensor.fill_(1.0);
  } else if (ends_with(".bias")) {
    tensor.zero_();
  } else if (ends_with("c_proj.weight")) {
    // Residual projections scaled by 1/sqrt(2 * n_layer), as GPT-2's paper and Hugging Face do.
    tensor.normal_(0.0, std / std::sqrt(2.0 * static_cast<double>(config.n_layer)));
  } else {
    tensor.normal_(0.0, std);
  }
}

void GPT2LMHeadModelImpl::reset_parameters() {
  // A split parameter is drawn whole and sliced, in the same order as unsplit: every rank draws
  // the same numbers (staying in step) and holds its part of the unsplit model's weights.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const ParameterShard& shard = shards_.at(item.key());
    if (shard.spec.kind == ShardSpec::Kind::kReplicated) {
      init_gpt2_parameter(item.key(), item.value(), config_);
    } else {
      torch::Tensor full = torch::empty(shard.full_shape, item.value().options());
      init_gpt2_parameter(item.key(), full, config_);
      item.value().copy_(shard_tensor(full, shard.spec, tp_->rank(), tp_->size()));
    }
  }
}

void GPT2LMHeadModelImpl::set_context_parallel(std::shared_ptr<ContextParallelGroup> cp) {
  cp_ = std::move(cp);
  for (size_t i = 0; i < transformer->h->size(); ++i) transformer->h->ptr<GPT2BlockImpl>(i)->attn->set_context_parallel(cp_);
}

void GPT2LMHeadModelImpl::set_sequence_parallel(bool on) {
  if (on && (!tp_ || tp_->size() < 2)) {
    throw std::invalid_argument("--sequence_parallel splits the sequence over the tensor-parallel group: it needs "
                                "--tensor_parallel_size of 2 or more (this model is split over " +
                                std::to_string(tp_ ? tp_->size() : 1) + ")");
  }
  sp_ = on;
}

int64_t GPT2LMHeadModelImpl::sequence_split_of(int64_t rows, int64_t tokens) const {
  if (!sp_) return kWhole;
  const int tp_size = tp_->size();
  if (rows % tp_size == 0) return 0;
  if (tokens % tp_size != 0) {
    throw std::invalid_argument("--sequence_parallel: " + std::to_string(rows) + " rows of " + std::to_string(tokens) +
                                " positions" + (cp_ ? " (this context rank's shard)" : std::string()) +
                                ": neither is divisible over --tensor_parallel_size " + std::to_string(tp_size));
  }
  return 1;
}

torch::Tensor GPT2LMHeadModelImpl::embed(const torch::Tensor& input_ids, int64_t past_length) {
  return embed_at(input_ids, past_length, cp_ && past_length == 0, sp_ && past_length == 0);
}

torch::Tensor GPT2LMHeadModelImpl::embed_cached(const torch::Tensor& input_ids, const KVCache& cache) {
  return embed_at(input_ids, cache.length(), /*context_shard=*/false, /*sequence_split=*/false);
}

torch::Tensor GPT2LMHeadModelImpl::embed_at(const torch::Tensor& input_ids, int64_t past_length, bool context_shard,
                                            bool sequence_split) {
  if (input_ids.dim() != 2) {
    throw std::invalid_argument("GPT2LMHeadModel: input_ids must be [B, T], got shape " +
                                shape_str(input_ids.sizes()));
  }
  const int64_t T = input_ids.size(1);
  if (context_shard) {
    const int C = cp_->size();
    const int64_t S = T * C;
    if (S > config_.n_positions) {
      throw std::invalid_argument("GPT2LMHeadModel: a shard of " + std::to_string(T) + " positions on each of " +
                                  std::to_string(C) + " context ranks is a sequence of " + std::to_string(S) +
                                  ", which exceeds n_positions " + std::to_string(config_.n_positions));
    }
    check_zigzag_split(S, C);
  } else if (past_length + T > config_.n_positions) {
    throw std::invalid_argument("GPT2LMHeadModel: sequence of " + std::to_string(past_length + T) +
                                " positions (" + std::to_string(past_length) + " cached + " +
                                std::to_string(T) + " new) exceeds n_positions " +
                                std::to_string(config_.n_positions));
  }
  auto& wte = transformer->wte;
  auto ids = input_ids.to(wte->weight.device(), torch::kLong);
  if (ids.is_cpu() && ids.numel() > 0) {  // on a GPU this check would cost a synchronisation
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    if (lo < 0 || hi >= config_.vocab_size) {
      throw std::invalid_argument("GPT2LMHeadModel: token id " + std::to_string(lo < 0 ? lo : hi) +
                                  " is outside the vocabulary [0, " +
                                  std::to_string(config_.vocab_size) + ")");
    }
  }
  torch::Tensor positions =
      (context_shard ? torch::tensor(zigzag_positions(T * cp_->size(), cp_->size(), cp_->rank()), torch::kLong)
                           .to(ids.device())
                     : torch::arange(past_length, past_length + T,
                                     torch::TensorOptions().dtype(torch::kLong).device(ids.device())))
          .unsqueeze(0);
  auto& wpe = transformer->wpe;
  if (!sequence_split) {
    const torch::Tensor tokens = tp_ ? vocab_parallel_embedding(ids, wte->weight, config_.vocab_size, *tp_) : wte(ids);
    return model::dropout(tokens + wpe(positions.to(wpe->weight.device())), transformer->drop);
  }
  // Sequence parallel: the vocabulary slices' rows reduce-scattered over the group, each rank
  // adding its part's positions (wpe's gradient, partial, summed over the group). The split is
  // along the rows where the batch's rows divide by T (each rank's part is contiguous: no
  // reordering around the collectives), else along the sequence.
  const int tp_size = tp_->size();
  split_sequences_as(ids.size(0), T);
  const torch::Tensor tokens = vocab_parallel_embedding(ids, wte->weight, config_.vocab_size, *tp_, split_dim_);
  if (split_dim_ == 1) positions = positions.narrow(1, tp_->rank() * (T / tp_size), T / tp_size);
  const torch::Tensor placed = torch::embedding(tp_->copy_to_region(wpe->weight), positions.to(wpe->weight.device()));
  return split_dropout(tokens + placed, transformer->drop, tp_.get());
}

torch::Tensor GPT2LMHeadModelImpl::forward_units(torch::Tensor hidden, int64_t first_unit, int64_t end_unit,
                                                 KVCache* cache) {
  if (first_unit < 0 || end_unit > n_units() || first_unit > end_unit) {
    throw std::invalid_argument("GPT2LMHeadModel: block halves [" + std::to_string(first_unit) + ", " +
                                std::to_string(end_unit) + ") are outside the model's [0, " +
                                std::to_string(n_units()) + ")");
  }
  if (cache != nullptr && cache->layers.empty()) cache->layers.resize(transformer->h->size());
  const int64_t split_dim = sp_ && cache == nullptr ? split_dim_ : kWhole;
  for (int64_t unit = first_unit; unit < end_unit; ++unit) {
    auto block = transformer->h->ptr<GPT2BlockImpl>(static_cast<size_t>(unit / 2));
    if (unit % 2 == 1) {
      hidden = block->forward_mlp(hidden, split_dim);
      continue;
    }
    hidden = hidden.to(block->ln_1->weight.device());
    hidden = cache == nullptr ? block->forward_attention(hidden, split_dim)
                              : hidden + block->attn->forward(block->ln_1(hidden), &cache->layers[unit / 2]);
  }
  return hidden;
}

torch::Tensor GPT2LMHeadModelImpl::head_slice(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                              int64_t split_dim) {
  auto& ln_f = transformer->ln_f;
  TensorParallelGroup* split_over = split_dim >= 0 ? tp_.get() : nullptr;
  torch::Tensor normed = layer_norm(ln_f, hidden.to(ln_f->weight.device()), split_over).to(head_weight.device());
  // Split, the head is column-parallel over the vocabulary: its input's gradient is summed (and
  // with sequence parallelism its input is first gathered whole).
  if (split_over != nullptr) {
    normed = tp_->gather_sequence(normed, split_dim);
  } else if (tp_) {
    normed = tp_->copy_to_region(normed);
  }
  return vocabulary_logits(normed, head_weight);
}

torch::Tensor GPT2LMHeadModelImpl::head_logits(const torch::Tensor& hidden, const torch::Tensor& head_weight) {
  const torch::Tensor logits = head_slice(hidden, head_weight);
  return tp_ ? vocab_parallel_gather(logits, config_.vocab_size, *tp_) : logits;
}

torch::Tensor GPT2LMHeadModelImpl::head_loss(const torch::Tensor& hidden, const torch::Tensor& labels,
                                             const torch::Tensor& weights, const torch::Tensor& weight_sum,
                                             const torch::Tensor& head_weight) {
  const torch::Tensor logits =
      head_slice(hidden, head_weight.defined() ? head_weight : transformer->wte->weight, sp_ ? split_dim_ : kWhole);
  const torch::Tensor on_labels = labels.to(logits.device()), on_weights = weights.to(logits.device());
  if (cp_) {
    // The divisor is the whole sequences' label weight: given, or every rank's part of it summed.
    torch::Tensor total = weight_sum;
    if (!total.defined()) {
      total = on_weights.to(torch::kFloat32).sum();
      cp_->all_reduce_sum(total);
    }
    if (!weight_sum.defined() && total.item<float>() == 0.0f) {
      throw std::invalid_argument("weighted_cross_entropy: label_token_weights of the " + std::to_string(cp_->size()) +
                                  " context ranks' shards sum to 0 (no target token to learn from)");
    }
    const torch::Tensor part =
        tp_ ? vocab_parallel_weighted_cross_entropy(logits, on_labels, on_weights, total, config_.vocab_size, *tp_)
            : weighted_cross_entropy(logits, on_labels, on_weights, total);
    return ContextSum::apply(part, cp_.get());
  }
  if (tp_) {
    return vocab_parallel_weighted_cross_entropy(logits, on_labels, on_weights, weight_sum, config_.vocab_size, *tp_);
  }
  return weight_sum.defined() ? weighted_cross_entropy(logits, on_labels, on_weights, weight_sum)
                              : weighted_cross_entropy(logits, on_labels, on_weights);
}

int64_t GPT2LMHeadModelImpl::head_next_token(const torch::Tensor& hidden, int64_t vocabulary,
                                             const torch::Tensor& head_weight) {
  if (vocabulary < 1 || vocabulary > config_.vocab_size) {
    throw std::invalid_argument("head_next_token: " + std::to_string(vocabulary) +
                                " competing ids do not fit the model's vocab_size " +
                                std::to_string(config_.vocab_size));
  }
  const torch::Tensor logits = head_slice(hidden, head_weight.defined() ? head_weight : transformer->wte->weight);
  const torch::Tensor last = logits.index({0, -1});
  if (!tp_) return last.narrow(0, 0, vocabulary).argmax().item<int64_t>();
  return vocab_parallel_argmax(last.unsqueeze(0), config_.vocab_size, vocabulary, *tp_)[0].item<int64_t>();
}

torch::Tensor GPT2LMHeadModelImpl::loss(const torch::Tensor& input_ids, const torch::Tensor& labels,
                                        const torch::Tensor& weights, const torch::Tensor& weight_sum) {
  check_no_executor_with_sequence_parallel();
  auto hidden = embed(input_ids, 0);
  hidden = blocks_executor_ ? blocks_executor_(hidden) : forward_units(hidden, 0, n_units());
  return head_loss(hidden, labels, weights, weight_sum);
}

torch::Tensor GPT2LMHeadModelImpl::forward(const torch::Tensor& input_ids) {
  check_no_executor_with_sequence_parallel();
  auto hidden = embed(input_ids, 0);
  hidden = blocks_executor_ ? blocks_executor_(hidden) : forward_units(hidden, 0, n_units());
  const torch::Tensor logits = head_slice(hidden, transformer->wte->weight, sp_ ? split_dim_ : kWhole);
  return tp_ ? vocab_parallel_gather(logits, config_.vocab_size, *tp_) : logits;
}

void GPT2LMHeadModelImpl::check_no_executor_with_sequence_parallel() const {
  if (sp_ && blocks_executor_) {
    throw std::invalid_argument("--sequence_parallel: the blocks run through an installed executor (a pipeline), "
                                "which passes whole sequences");
  }
}

torch::Tensor GPT2LMHeadModelImpl::hidden_cached(const torch::Tensor& input_ids, KVCache& cache) {
  const size_t n_layer = transformer->h->size();
  if (cache.layers.empty()) cache.layers.resize(n_layer);
  if (cache.layers.size() != n_layer) {
    throw std::invalid_argument("GPT2LMHeadModel: KV cache has " +
                                std::to_string(cache.layers.size()) + " layers, the model " +
                                std::to_string(n_layer));
  }
  auto hidden = embed_at(input_ids, cache.length(), /*context_shard=*/false, /*sequence_split=*/false);
  for (size_t i = 0; i < n_layer; ++i) {
    auto block = transformer->h->ptr<GPT2BlockImpl>(i);
    hidden = block->forward_cached(hidden.to(block->ln_1->weight.device()), cache.layers[i]);
  }
  return hidden;
}

torch::Tensor GPT2LMHeadModelImpl::forward_cached(const torch::Tensor& input_ids, KVCache& cache) {
  return head_logits(hidden_cached(input_ids, cache), transformer->wte->weight);
}

int64_t GPT2LMHeadModelImpl::next_token(const torch::Tensor& input_ids, KVCache& cache, int64_t vocabulary) {
  return head_next_token(hidden_cached(input_ids, cache), vocabulary);
}

void GPT2LMHeadModelImpl::parallelize(const std::vector<Device>& devices) {
  if (devices.empty()) throw std::invalid_argument("parallelize: no devices given");
  const int64_t n_layer = config_.n_layer;
  const int64_t n_devices = static_cast<int64_t>(devices.size());
  const int64_t run = (n_layer + n_devices - 1) / n_devices;
  const int64_t used = (n_layer + run - 1) / run;
  if (used < n_devices) {
    throw std::invalid_argument(
        "parallelize: n_layer " + std::to_string(n_layer) + " over " + std::to_string(n_devices) +
        " devices gives runs of ceil(" + std::to_string(n_layer) + "/" + std::to_string(n_devices) +
        ") = " + std::to_string(run) + " blocks, which leaves " + devices[used].str() +
        " (and any after it) without a block; use at most " + std::to_string(used) + " devices");
  }
  std::vector<Device> block_devices;
  for (int64_t i = 0; i < n_layer; ++i) block_devices.push_back(devices[static_cast<size_t>(i / run)]);
  place(block_devices);
}

void GPT2LMHeadModelImpl::place(const std::vector<Device>& block_devices) {
  place(block_devices, block_devices);
}

void GPT2LMHeadModelImpl::place(const std::vector<Device>& attention_devices, const std::vector<Device>& mlp_devices) {
  const size_t n = transformer->h->size();
  if (attention_devices.size() != n || mlp_devices.size() != n) {
    throw std::invalid_argument("place: " + std::to_string(attention_devices.size()) + " and " +
                                std::to_string(mlp_devices.size()) + " devices given for " + std::to_string(n) +
                                " blocks");
  }
  first_device_ = attention_devices.front();
  last_device_ = mlp_devices.back();
  transformer->wte->to(first_device_.torch_device());
  transformer->wpe->to(first_device_.torch_device());
  block_devices_ = attention_devices;
  for (size_t i = 0; i < n; ++i) {
    auto block = transformer->h->ptr<GPT2BlockImpl>(i);
    block->ln_1->to(attention_devices[i].torch_device());
    block->attn->to(attention_devices[i].torch_device());
    block->ln_2->to(mlp_devices[i].torch_device());
    block->mlp->to(mlp_devices[i].torch_device());
  }
  transformer->ln_f->to(last_device_.torch_device());
}

// ----- the unsplit model's view ---------------------------------------------------------------

int64_t GPT2LMHeadModelImpl::unsplit_parameter_count() const {
  int64_t total = 0;
  for (const auto& [name, shard] : shards_) {
    int64_t n = 1;
    for (int64_t d : shard.full_shape) n *= d;
    total += n;
  }
  return total;
}

torch::Tensor GPT2LMHeadModelImpl::unshard(const std::string& name, const torch::Tensor& local) {
  auto shard = shards_.find(name);
  if (shard == shards_.end()) throw std::invalid_argument("unshard: the model has no parameter " + name);
  torch::NoGradGuard no_grad;
  if (!tp_ || shard->second.spec.kind == ShardSpec::Kind::kReplicated) {
    return local.detach().to(torch::kCPU).contiguous();
  }
  // The group's collectives run on the parameters' device.
  const auto params = named_parameters();
  const torch::Tensor here = local.detach().to(params.find(name)->device());
  if (shard->second.spec.kind != ShardSpec::Kind::kBalancedRows) {
    return unshard_tensor(tp_->all_gather(here), shard->second.spec).to(torch::kCPU).contiguous();
  }
  // Rows split unevenly: every rank sends as many as the widest (the all-gather wants one shape),
  // and each rank's own are cut back out.
  const int T = tp_->size();
  const int64_t rows = shard->second.full_shape.front(), widest = vocabulary_range(rows, 0, T).size();
  if (here.dim() < 1 || here.size(0) != vocabulary_range(rows, tp_->rank(), T).size()) {
    throw std::invalid_argument("unshard: " + name + " on rank " + std::to_string(tp_->rank()) + " has shape " +
                                shape_str(here.sizes()) + ", not this rank's rows of " +
                                shape_str(shard->second.full_shape));
  }
  std::vector<torch::Tensor> parts =
      tp_->all_gather(torch::constant_pad_nd(here, {0, 0, 0, widest - here.size(0)}).contiguous());
  for (int t = 0; t < T; ++t) {
    parts[static_cast<size_t>(t)] = parts[static_cast<size_t>(t)].narrow(0, 0, vocabulary_range(rows, t, T).size());
  }
  return unshard_tensor(parts, shard->second.spec).to(torch::kCPU).contiguous();
}

torch::Tensor GPT2LMHeadModelImpl::shard(const std::string& name, const torch::Tensor& full) const {
  auto shard = shards_.find(name);
  if (shard == shards_.end()) throw std::invalid_argument("shard: the model has no parameter " + name);
  if (full.sizes() != at::IntArrayRef(shard->second.full_shape)) {
    throw std::invalid_argument("tensor " + name + " has shape " + shape_str(full.sizes()) +
                                ", expected the unsplit " + shape_str(shard->second.full_shape));
  }
  return tp_ ? shard_tensor(full, shard->second.spec, tp_->rank(), tp_->size()) : full;
}

void GPT2LMHeadModelImpl::for_each_full(bool gradients,
                                        const std::function<void(const std::string&, const torch::Tensor&)>& visit) {
  // Every rank of the group walks the parameters in the same order and has the same gradients
  // defined (the graphs are the same), so the gathers match across the group.
  for (const auto& item : named_parameters()) {
    const torch::Tensor local = gradients ? item.value().grad() : item.value();
    if (!local.defined()) continue;
    visit(item.key(), unshard(item.key(), local));
  }
}

NamedTensors GPT2LMHeadModelImpl::full_state() {
  NamedTensors out;
  for_each_full(false, [&](const std::string& name, const torch::Tensor& t) { out.emplace_back(name, t); });
  return out;
}

NamedTensors GPT2LMHeadModelImpl::full_gradients() {
  NamedTensors out;
  for_each_full(true, [&](const std::string& name, const torch::Tensor& t) { out.emplace_back(name, t); });
  return out;
}

void GPT2LMHeadModelImpl::load_full_state(const NamedTensors& full) {
  torch::NoGradGuard no_grad;
  auto params = named_parameters();
  load_full_state(full, [&](const std::string& name, const torch::Tensor& local) {
    torch::Tensor& p = params[name];
    p.copy_(local.to(p.device(), p.scalar_type()));
  });
}

void GPT2LMHeadModelImpl::load_full_state(const NamedTensors& full,
                                          const std::function<void(const std::string&, const torch::Tensor&)>& load) {
  std::map<std::string, torch::Tensor> given;
  for (const auto& [raw_name, tensor] : full) {
    const std::string name = raw_name.rfind("transformer.", 0) == 0 ? raw_name : "transformer." + raw_name;
    if (!shards_.count(name)) {
      throw std::invalid_argument("weights for " + raw_name + ", which the model does not have (n_layer " +
                                  std::to_string(config_.n_layer) + ")");
    }
    if (!given.emplace(name, tensor).second) throw std::invalid_argument("weights for " + name + " are given twice");
  }
  std::vector<std::string> missing;
  for (const auto& [name, shard] : shards_) {
    if (!given.count(name)) missing.push_back(name);
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    throw std::invalid_argument(std::to_string(missing.size()) + " of the model's parameters have no weights: " +
                                list + (missing.size() > 8 ? ", ..." : ""));
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : named_parameters()) {
    load(item.key(), shard(item.key(), given.at(item.key())));  // shard() checks the unsplit shape
  }
}

double GPT2LMHeadModelImpl::replicated_gradient_divergence() {
  if (!tp_) return 0.0;
  torch::NoGradGuard no_grad;
  double worst = 0.0;
  for (const auto& item : named_parameters()) {
    if (shards_.at(item.key()).spec.kind != ShardSpec::Kind::kReplicated) continue;
    const torch::Tensor& grad = item.value().grad();
    if (!grad.defined()) continue;
    const std::vector<torch::Tensor> all = tp_->all_gather(grad);
    worst = std::max(worst, (grad - all.front()).abs().max().item<double>());
  }
  return worst;
}

torch::Tensor vocabulary_logits(const torch::Tensor& hidden, const torch::Tensor& weight) {
  WeightGradStore* store = deferring_store(hidden, weight);
  if (PaddedVocabularyProjection::applies(hidden, weight)) {
    if (store == nullptr) return PaddedVocabularyProjection::apply(hidden, weight);
    const int64_t V = weight.size(0), C = weight.size(1);
    // Given the weight detached, the Function's backward computes the hidden states' gradient
    // alone; its weight gradient, mm(grad.t(), rows) there, is deferred here.
    torch::Tensor logits = PaddedVocabularyProjection::apply(hidden, weight.detach());
    logits.register_hook([store, weight, rows = hidden.detach().reshape({-1, C}), V](const torch::Tensor& grad) {
      if (!grad.defined()) return;
      store->put(weight, [grad = grad.reshape({-1, V}), rows] { return torch::mm(grad.t(), rows); });
    });
    return logits;
  }
  if (store == nullptr) return torch::linear(hidden, weight);
  // torch::linear without a bias is matmul(hidden, weight.t()), which on a weight that requires
  // grad folds hidden's leading dimensions and runs one mm: that mm, on autocast's operands.
  const int64_t V = weight.size(0), C = weight.size(1);
  const torch::Tensor rows = autocast_operand(hidden).reshape({-1, C});
  const torch::Tensor mat2 = autocast_operand(weight).detach().t();
  torch::Tensor product = torch::mm(rows, mat2);
  defer_mat2_gradient(product, store, weight, rows, mat2, /*transposed=*/true);
  auto out_sizes = hidden.sizes().vec();
  out_sizes.back() = V;
  return product.view(out_sizes);
}

int64_t count_parameters(torch::nn::Module& module) {
  std::unordered_set<const void*> seen;
  int64_t total = 0;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) total += p.numel();
  }
  return total;
}

}  // namespace harness::model
