// The tensor-parallel GPT-2 (see gpt2_tensor_parallel.h): forward over shards, and the unsplit
// Hugging Face weights in and out.
#include "harness/tensor_parallel/gpt2_tensor_parallel.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "harness/tensor_parallel/comm_ops.h"

namespace harness::tensor_parallel {
namespace {

namespace dp = harness::data_parallel;
using model::GPT2Config;

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << ']';
  return out.str();
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

torch::nn::LayerNorm make_layer_norm(const GPT2Config& config) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.n_embd}).eps(config.layer_norm_epsilon));
}

int tp_size(const dp::DistContext& tp) {
  if (!tp.group) throw std::invalid_argument("tensor-parallel GPT-2: no tensor-parallel process group");
  return tp.world_size;
}

}  // namespace

void validate_tensor_parallel(const GPT2Config& config, int tensor_parallel_size) {
  config.validate();
  if (tensor_parallel_size < 1) {
    throw std::invalid_argument("--tensor_parallel_size " + std::to_string(tensor_parallel_size) +
                                " must be at least 1");
  }
  if (config.n_head % tensor_parallel_size != 0) {
    throw std::invalid_argument("tensor parallelism splits the attention heads: n_head " +
                                std::to_string(config.n_head) + " is not divisible by --tensor_parallel_size " +
                                std::to_string(tensor_parallel_size));
  }
  if (config.inner_dim() % tensor_parallel_size != 0) {
    throw std::invalid_argument("tensor parallelism splits the MLP: inner size " +
                                std::to_string(config.inner_dim()) + " is not divisible by --tensor_parallel_size " +
                                std::to_string(tensor_parallel_size));
  }
}

// ----- modules -------------------------------------------------------------------------------

TensorParallelGPT2AttentionImpl::TensorParallelGPT2AttentionImpl(const GPT2Config& config, dp::DistContext tp,
                                                                 std::shared_ptr<ParallelRegionRng> rng)
    : local_heads_(config.n_head / tp_size(tp)),
      head_dim_(config.head_dim()),
      rng_(rng ? std::move(rng) : std::make_shared<ParallelRegionRng>(tp.rank)) {
  ColumnParallelLinearOptions attn_options;
  attn_options.in_features = config.n_embd;
  attn_options.out_features = 3 * config.n_embd;
  attn_options.fused_parts = 3;  // [q | k | v], each split by heads
  c_attn = register_module("c_attn", ColumnParallelLinear(attn_options, tp));
  RowParallelLinearOptions proj_options;
  proj_options.in_features = config.n_embd;
  proj_options.out_features = config.n_embd;
  c_proj = register_module("c_proj", RowParallelLinear(proj_options, tp));
  attn_dropout = register_module("attn_dropout", torch::nn::Dropout(config.attn_pdrop));
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(config.resid_pdrop));
}

at::Tensor TensorParallelGPT2AttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t local_width = local_heads_ * head_dim_;
  auto qkv = c_attn(x).split(local_width, /*dim=*/2);
  auto heads = [&](const at::Tensor& t) {  // [B, T, local] -> [B, local_heads, T, head_dim]
    return t.view({B, T, local_heads_, head_dim_}).transpose(1, 2);
  };
  const double dropout_p = attn_dropout->is_training() ? attn_dropout->options.p() : 0.0;
  auto attend = [&] {
    return at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), std::nullopt,
                                            dropout_p, /*is_causal=*/T > 1,
                                            1.0 / std::sqrt(static_cast<double>(head_dim_)));
  };
  // The probabilities of this rank's heads exist only here: their dropout mask comes from the
  // rank's own stream, leaving the default generator in step with the other ranks.
  auto y = dropout_p > 0.0 ? rng_->run(x.device(), attend) : attend();
  y = y.transpose(1, 2).reshape({B, T, local_width});
  return resid_dropout(c_proj(y));
}

TensorParallelGPT2MLPImpl::TensorParallelGPT2MLPImpl(const GPT2Config& config, dp::DistContext tp) {
  ColumnParallelLinearOptions fc_options;
  fc_options.in_features = config.n_embd;
  fc_options.out_features = config.inner_dim();
  c_fc = register_module("c_fc", ColumnParallelLinear(fc_options, tp));
  RowParallelLinearOptions proj_options;
  proj_options.in_features = config.inner_dim();
  proj_options.out_features = config.n_embd;
  c_proj = register_module("c_proj", RowParallelLinear(proj_options, tp));
  dropout = register_module("dropout", torch::nn::Dropout(config.resid_pdrop));
}

at::Tensor TensorParallelGPT2MLPImpl::forward(const at::Tensor& x) {
  // GELU is element-wise, so it applies to each rank's slice of the inner features unchanged.
  return dropout(c_proj(torch::gelu(c_fc(x), "tanh")));
}

TensorParallelGPT2BlockImpl::TensorParallelGPT2BlockImpl(const GPT2Config& config, dp::DistContext tp,
                                                         std::shared_ptr<ParallelRegionRng> rng) {
  ln_1 = register_module("ln_1", make_layer_norm(config));
  attn = register_module("attn", TensorParallelGPT2Attention(config, tp, std::move(rng)));
  ln_2 = register_module("ln_2", make_layer_norm(config));
  mlp = register_module("mlp", TensorParallelGPT2MLP(config, tp));
}

at::Tensor TensorParallelGPT2BlockImpl::forward(const at::Tensor& x) {
  auto h = x + attn(ln_1(x));
  return h + mlp(ln_2(h));
}

TensorParallelGPT2ModelImpl::TensorParallelGPT2ModelImpl(const GPT2Config& config, dp::DistContext tp,
                                                         std::shared_ptr<ParallelRegionRng> rng) {
  if (!rng) rng = std::make_shared<ParallelRegionRng>(tp.rank);  // one stream for all blocks
  rng_ = rng;
  wte = register_module("wte", torch::nn::Embedding(config.vocab_size, config.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(config.n_positions, config.n_embd));
  drop = register_module("drop", torch::nn::Dropout(config.embd_pdrop));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer; ++i) h->push_back(TensorParallelGPT2Block(config, tp, rng));
  ln_f = register_module("ln_f", make_layer_norm(config));
}

// ----- the LM head model ---------------------------------------------------------------------

TensorParallelGPT2LMHeadModelImpl::TensorParallelGPT2LMHeadModelImpl(const GPT2Config& config,
                                                                     dp::DistContext tp)
    : config_(config), tp_(std::move(tp)) {
  validate_tensor_parallel(config_, tp_size(tp_));
  transformer = register_module("transformer", TensorParallelGPT2Model(config_, tp_));
  for (const auto& item : named_parameters()) {
    shards_[item.key()] = ParameterShard{ShardSpec{}, item.value().sizes().vec()};
  }
  auto record = [&](const std::string& prefix, const auto& layer) {
    const auto& o = layer->options();
    shards_[prefix + ".weight"] = ParameterShard{layer->weight_spec(), {o.in_features, o.out_features}};
    shards_[prefix + ".bias"] = ParameterShard{layer->bias_spec(), {o.out_features}};
  };
  for (size_t i = 0; i < transformer->h->size(); ++i) {
    auto block = transformer->h->ptr<TensorParallelGPT2BlockImpl>(i);
    const std::string prefix = "transformer.h." + std::to_string(i);
    record(prefix + ".attn.c_attn", block->attn->c_attn);
    record(prefix + ".attn.c_proj", block->attn->c_proj);
    record(prefix + ".mlp.c_fc", block->mlp->c_fc);
    record(prefix + ".mlp.c_proj", block->mlp->c_proj);
  }
  reset_parameters();
}

void TensorParallelGPT2LMHeadModelImpl::reset_parameters() {
  // Draws each unsplit tensor as model::GPT2LMHeadModelImpl::reset_parameters does, in the same
  // order, and keeps this rank's shard: all ranks draw the same numbers and stay in step.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    const ParameterShard& shard = shards_.at(name);
    at::Tensor full = torch::empty(shard.full_shape, item.value().options());
    model::init_gpt2_parameter(name, full, config_);
    item.value().copy_(shard_tensor(full, shard.spec, tp_.rank, tp_.world_size));
  }
}

at::Tensor TensorParallelGPT2LMHeadModelImpl::embed(const at::Tensor& input_ids) {
  if (input_ids.dim() != 2) {
    throw std::invalid_argument("TensorParallelGPT2LMHeadModel: input_ids must be [B, T], got shape " +
                                shape_str(input_ids.sizes()));
  }
  const int64_t T = input_ids.size(1);
  if (T > config_.n_positions) {
    throw std::invalid_argument("TensorParallelGPT2LMHeadModel: sequence of " + std::to_string(T) +
                                " positions exceeds n_positions " + std::to_string(config_.n_positions));
  }
  auto ids = input_ids.to(transformer->wte->weight.device(), torch::kLong);
  if (ids.is_cpu() && ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    if (lo < 0 || hi >= config_.vocab_size) {
      throw std::invalid_argument("TensorParallelGPT2LMHeadModel: token id " +
                                  std::to_string(lo < 0 ? lo : hi) + " is outside the vocabulary [0, " +
                                  std::to_string(config_.vocab_size) + ")");
    }
  }
  auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(ids.device())).unsqueeze(0);
  return transformer->drop(transformer->wte(ids) + transformer->wpe(positions));
}

at::Tensor TensorParallelGPT2LMHeadModelImpl::forward(const at::Tensor& input_ids) {
  auto hidden = embed(input_ids);
  for (size_t i = 0; i < transformer->h->size(); ++i) {
    hidden = transformer->h->ptr<TensorParallelGPT2BlockImpl>(i)->forward(hidden);
  }
  return torch::linear(transformer->ln_f(hidden), transformer->wte->weight);
}

void TensorParallelGPT2LMHeadModelImpl::load_full_state(const model::NamedTensors& full) {
  std::unordered_map<std::string, at::Tensor> given;
  for (const auto& [raw_name, tensor] : full) {
    const std::string name = raw_name.rfind("transformer.", 0) == 0 ? raw_name : "transformer." + raw_name;
    auto shard = shards_.find(name);
    if (shard == shards_.end()) {
      throw std::invalid_argument("tensor-parallel GPT-2: tensor " + raw_name +
                                  " is not a parameter of this model (n_layer " +
                                  std::to_string(config_.n_layer) + ")");
    }
    if (tensor.sizes() != at::IntArrayRef(shard->second.full_shape)) {
      throw std::invalid_argument("tensor-parallel GPT-2: tensor " + name + " has shape " +
                                  shape_str(tensor.sizes()) + ", expected the unsplit " +
                                  shape_str(shard->second.full_shape));
    }
    if (!given.emplace(name, tensor).second) {
      throw std::invalid_argument("tensor-parallel GPT-2: tensor " + name + " is given twice");
    }
  }
  std::vector<std::string> missing;
  for (const auto& item : named_parameters()) {
    if (!given.count(item.key())) missing.push_back(item.key());
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    throw std::invalid_argument("tensor-parallel GPT-2: " + std::to_string(missing.size()) +
                                " tensor(s) missing: " + list + (missing.size() > 8 ? ", ..." : ""));
  }
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const at::Tensor local = shard_tensor(given.at(item.key()), shards_.at(item.key()).spec, tp_.rank,
                                          tp_.world_size);
    item.value().copy_(local.to(item.value().device(), item.value().scalar_type()));
  }
}

void TensorParallelGPT2LMHeadModelImpl::load_from(model::GPT2LMHeadModelImpl& full) {
  model::NamedTensors tensors;
  for (const auto& item : full.named_parameters()) tensors.emplace_back(item.key(), item.value().detach());
  load_full_state(tensors);
}

model::NamedTensors TensorParallelGPT2LMHeadModelImpl::gather(bool gradients) {
  torch::NoGradGuard no_grad;
  model::NamedTensors out;
  for (const auto& item : named_parameters()) {
    at::Tensor local = gradients ? item.value().grad() : item.value();
    if (!local.defined()) continue;  // the same on every rank: the graphs are the same
    local = local.detach();
    const ShardSpec& spec = shards_.at(item.key()).spec;
    at::Tensor full = spec.kind == ShardSpec::Kind::kReplicated
                          ? local.clone()
                          : unshard_tensor(all_gather(local, tp_), spec);
    out.emplace_back(item.key(), full.to(torch::kCPU).contiguous());
  }
  return out;
}

model::NamedTensors TensorParallelGPT2LMHeadModelImpl::gather_full_state() { return gather(false); }
model::NamedTensors TensorParallelGPT2LMHeadModelImpl::gather_full_gradients() { return gather(true); }

void TensorParallelGPT2LMHeadModelImpl::copy_into(model::GPT2LMHeadModelImpl& full) {
  const model::NamedTensors state = gather_full_state();
  auto params = full.named_parameters();
  torch::NoGradGuard no_grad;
  for (const auto& [name, tensor] : state) {
    at::Tensor* p = params.find(name);
    if (p == nullptr) {
      throw std::invalid_argument("copy_into: the unsplit model has no parameter " + name);
    }
    if (p->sizes() != tensor.sizes()) {
      throw std::invalid_argument("copy_into: " + name + " is " + shape_str(tensor.sizes()) +
                                  " here and " + shape_str(p->sizes()) + " in the unsplit model");
    }
    p->copy_(tensor.to(p->device(), p->scalar_type()));
  }
}

double TensorParallelGPT2LMHeadModelImpl::replicated_gradient_divergence() {
  torch::NoGradGuard no_grad;
  double worst = 0.0;
  for (const auto& item : named_parameters()) {
    if (shards_.at(item.key()).spec.kind != ShardSpec::Kind::kReplicated) continue;
    const at::Tensor& grad = item.value().grad();
    if (!grad.defined()) continue;
    const std::vector<at::Tensor> all = all_gather(grad, tp_);
    worst = std::max(worst, (grad - all.front()).abs().max().item<double>());
  }
  return worst;
}

// ----- files ---------------------------------------------------------------------------------

void load_pretrained(TensorParallelGPT2LMHeadModelImpl& model, const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "model.safetensors").string();
  model::NamedTensors tensors;
  at::Tensor lm_head, wte;
  for (auto& [name, tensor] : model::read_safetensors(path)) {
    if (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias")) continue;
    if (name == "lm_head.weight") {
      lm_head = tensor.to(torch::kFloat);
      continue;
    }
    if (name == "wte.weight" || name == "transformer.wte.weight") wte = tensor.to(torch::kFloat);
    tensors.emplace_back(name, tensor.to(torch::kFloat));
  }
  if (lm_head.defined() && wte.defined() && (lm_head.sizes() != wte.sizes() || !torch::equal(lm_head, wte))) {
    throw std::invalid_argument(path + ": lm_head.weight differs from transformer.wte.weight; untied LM heads are not supported");
  }
  try {
    model.load_full_state(tensors);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
}

void save_pretrained(TensorParallelGPT2LMHeadModelImpl& model, const std::string& dir) {
  const model::NamedTensors state = model.gather_full_state();
  if (model.tensor_context().rank != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(dir + ": cannot create directory: " + ec.message());
  model.config().save_json_file((std::filesystem::path(dir) / "config.json").string());
  model::write_safetensors((std::filesystem::path(dir) / "model.safetensors").string(), state);
}

}  // namespace harness::tensor_parallel
