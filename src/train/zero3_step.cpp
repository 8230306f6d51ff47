// --zero_stage 3's step parts (see zero3_step.h).
#include "harness/train/zero3_step.h"

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <optional>
#include <stdexcept>

#include "harness/model/loss.h"
#include "harness/model/precision.h"
#include "harness/model/safetensors.h"
#include "harness/optim/fused_adamw.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;

// Where each of the model's parameters is among the units: (unit, position), by name.
std::map<std::string, std::pair<size_t, size_t>> places_of(const dp::ShardedUnits& units) {
  std::map<std::string, std::pair<size_t, size_t>> out;
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t k = 0; k < units.unit(u).names.size(); ++k) out[units.unit(u).names[k]] = {u, k};
  }
  return out;
}

class Zero3ForwardBackward final : public ForwardBackward {
 public:
  Zero3ForwardBackward(model::GPT2LMHeadModel model, dp::ShardedUnits& units, int prefetch)
      : model_(std::move(model)), units_(units), prefetch_(prefetch), order_(zero3_use_order(model_->config().n_layer)) {}

  at::Tensor run(const data::Batch& batch, const at::Tensor& weight_sum, int64_t k,
                 model::Precision precision) override {
    const int64_t L = model_->config().n_layer;
    at::Tensor loss;
    std::vector<at::Tensor> outputs;  // each block's output
    {
      model::AutocastScope autocast(precision, batch.input_ids.device().type());
      size_t s = 0;
      use(s);
      at::Tensor hidden = model_->embed(batch.input_ids);
      units_.release(0);  // the head gathers it again; the embeddings' backward needs no weight
      for (int64_t i = 0; i < L; ++i) {
        use(++s);
        hidden = model_->forward_units(hidden, 2 * i, 2 * i + 2);
        units_.release(static_cast<size_t>(i + 1));  // gathered again for its backward
        outputs.push_back(hidden);
      }
      use(++s);  // the head: unit 0 again
      const at::Tensor logits = model_->head_logits(hidden, model_->transformer->wte->weight);
      const at::Tensor labels = batch.labels.to(logits.device());
      const at::Tensor weights = batch.label_token_weights.to(logits.device());
      loss = weight_sum.defined() ? model::weighted_cross_entropy(logits, labels, weights, weight_sum)
                                  : model::weighted_cross_entropy(logits, labels, weights);
      // Backward: block i's output gets its gradient right before block i's backward, which
      // needs the block's weights again (the last block's, once the head's backward is done,
      // which lets unit 0's weights go: its gradients keep accumulating).
      const size_t head = s;
      for (int64_t i = L - 1; i >= 0; --i) {
        const size_t at_use = head + static_cast<size_t>(L - i);
        const bool last = i == L - 1;
        outputs[static_cast<size_t>(i)].register_hook([this, at_use, last](at::Tensor grad) -> at::Tensor {
          if (last) units_.release(0);
          use(at_use);
          return grad;
        });
      }
    }
    loss.backward();
    return loss.detach();
  }
  c10::Device input_device() const override { return model_->first_device().torch_device(); }
  c10::Device loss_device() const override { return model_->last_device().torch_device(); }

 private:
  // Use s of the step's order: the next `prefetch` uses' units are on their way, and this one's here.
  void use(size_t s) {
    for (size_t j = 1; j <= static_cast<size_t>(prefetch_) && s + j < order_.size(); ++j) units_.gather(order_[s + j]);
    units_.wait(order_.at(s));
  }

  model::GPT2LMHeadModel model_;
  dp::ShardedUnits& units_;
  int prefetch_;
  std::vector<size_t> order_;
};

class Zero3AdamW final : public StepOptimizer {
 public:
  Zero3AdamW(model::GPT2LMHeadModel model, const OptimizerSettings& settings, dp::ShardedUnits& units)
      : model_(std::move(model)), settings_(settings), units_(units), places_(places_of(units)) {
    options_.lr = settings.learning_rate;
    options_.weight_decay = settings.weight_decay;
    for (size_t u = 0; u < units_.size(); ++u) {
      exp_avg_.push_back(torch::zeros_like(units_.weight_chunk(u)));
      exp_avg_sq_.push_back(torch::zeros_like(units_.weight_chunk(u)));
    }
  }

  void zero_grad() override {
    units_.release_all();  // an evaluation's or a checkpoint's full copies
    units_.discard_gradients();
  }
  void step() override;
  void set_learning_rate(double learning_rate) override { options_.lr = learning_rate; }
  double learning_rate() const override { return options_.lr; }
  bool collective_state() const override { return true; }
  OptimizerState state() override;
  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override;
  bool stream_weights(const std::string& path, bool write) override;
  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override;
  model::NamedTensors unsplit_gradients() override;
  int64_t state_bytes() const override {
    int64_t bytes = 0;
    for (size_t u = 0; u < exp_avg_.size(); ++u) bytes += exp_avg_[u].nbytes() + exp_avg_sq_[u].nbytes();
    return bytes;
  }
  void gather_weights() override {
    units_.release_all();  // copies gathered before the last step are stale
    units_.gather_all();
  }

 private:
  // Every parameter in the model's order with unit u's chunks (`chunks`) gathered, one unit at a
  // time (collective): `take` sees each parameter's full tensor before the next unit is gathered.
  void for_each_full(const std::vector<at::Tensor>& chunks,
                     const std::function<void(const std::string&, const at::Tensor&)>& take) {
    std::optional<size_t> cached;
    std::vector<at::Tensor> parts;
    for (const auto& item : model_->named_parameters()) {
      const auto [u, k] = places_.at(item.key());
      if (cached != u) {
        parts = units_.gather_unit(u, chunks.at(u));
        cached = u;
      }
      take(item.key(), parts.at(k));
    }
  }
  std::vector<at::Tensor> weight_chunks() {
    std::vector<at::Tensor> out;
    for (size_t u = 0; u < units_.size(); ++u) out.push_back(units_.weight_chunk(u));
    return out;
  }

  model::GPT2LMHeadModel model_;
  OptimizerSettings settings_;
  dp::ShardedUnits& units_;
  std::map<std::string, std::pair<size_t, size_t>> places_;
  optim::AdamWHyperparameters options_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
};

void Zero3AdamW::step() {
  torch::NoGradGuard no_grad;
  // Each parameter's part of this rank's chunk normed on its own (as clip_grad_norm_ norms each
  // gradient), the squares summed over the ranks: the whole gradient's norm.
  const int64_t rank = units_.context().rank;
  std::vector<at::Tensor> pieces;
  for (size_t u = 0; u < units_.size(); ++u) {
    const int64_t chunk = units_.chunk_elements(u), begin = rank * chunk, end = begin + chunk;
    for (size_t k = 0; k < units_.unit(u).parameters.size(); ++k) {
      const int64_t offset = units_.offset_of(u, k), n = units_.unit(u).parameters[k].numel();
      const int64_t from = std::max(begin, offset), to = std::min(end, offset + n);
      if (from < to) pieces.push_back(units_.gradient_chunk(u).narrow(0, from - begin, to - from));
    }
  }
  double squares = 0.0;
  if (!pieces.empty()) squares = at::stack(at::_foreach_norm(pieces)).to(at::kDouble).square().sum().item<double>();
  std::vector<at::Tensor> total{torch::tensor({squares}, torch::kDouble).to(units_.context().device.torch_device())};
  if (units_.context().world_size > 1) units_.context().group->allreduce(total)->wait();
  last_grad_norm_ = std::sqrt(total[0].to(torch::kCPU).item<double>());
  const double coefficient = clip_coefficient(last_grad_norm_, settings_.max_grad_norm);
  ++step_;
  for (size_t u = 0; u < units_.size(); ++u) {
    at::Tensor gradient = units_.gradient_chunk(u);
    if (coefficient < 1.0) gradient.mul_(coefficient);
    optim::fused_adamw_update({units_.weight_chunk(u)}, {gradient}, {exp_avg_[u]}, {exp_avg_sq_[u]}, step_, options_);
  }
}

OptimizerState Zero3AdamW::state() {
  OptimizerState out;
  if (step_ == 0) return out;
  std::map<std::string, at::Tensor> first;
  for_each_full(exp_avg_, [&](const std::string& name, const at::Tensor& m) { first[name] = m.to(torch::kCPU, torch::kFloat, false, true); });
  for_each_full(exp_avg_sq_, [&](const std::string& name, const at::Tensor& v) {
    out[name] = {step_, first.at(name), v.to(torch::kCPU, torch::kFloat, false, true)};
  });
  return out;
}

bool Zero3AdamW::stream_weights(const std::string& path, bool write) {
  std::optional<model::SafetensorsWriter> weights;
  if (write) {
    std::vector<model::SafetensorsEntry> entries;
    for (const auto& item : model_->named_parameters()) {
      entries.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
    }
    weights.emplace(path, std::move(entries));
  }
  for_each_full(weight_chunks(), [&](const std::string&, const at::Tensor& w) {
    if (weights) weights->append(w);
  });
  if (weights) weights->finish();
  return true;
}

void Zero3AdamW::save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) {
  stream_weights(weights_path, write);
  std::vector<OptimizerStateWriter::Parameter> stepped;
  if (write && step_ > 0) {
    for (const auto& item : model_->named_parameters()) stepped.push_back({item.key(), step_, item.value().sizes().vec()});
  }
  // The two moments of a unit at a time: each parameter's pair goes into the file in order.
  std::optional<OptimizerStateWriter> moments;
  if (write) moments.emplace(optimizer_path, stepped);
  if (step_ > 0) {
    std::optional<size_t> cached;
    std::vector<at::Tensor> m, v;
    for (const auto& item : model_->named_parameters()) {
      const auto [u, k] = places_.at(item.key());
      if (cached != u) {
        m = units_.gather_unit(u, exp_avg_[u]);
        v = units_.gather_unit(u, exp_avg_sq_[u]);
        cached = u;
      }
      if (moments) moments->add(m.at(k), v.at(k));
    }
  }
  if (moments) moments->finish();
}

void Zero3AdamW::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
  units_.release_all();
  std::map<std::string, bool> seen;
  for (const auto& [name, full] : weights) {
    const std::string key = name.rfind("transformer.", 0) == 0 || name.rfind("lm_head", 0) == 0 ? name : "transformer." + name;
    auto it = places_.find(key);
    if (it == places_.end()) throw std::invalid_argument("weights for " + name + ", which the model does not have");
    const auto [u, k] = it->second;
    units_.copy_into_chunk(u, k, full, units_.weight_chunk(u));
    seen[key] = true;
  }
  for (const auto& [name, place] : places_) {
    if (!seen.count(name)) throw std::invalid_argument("weights: none for " + name);
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    exp_avg_[u].zero_();
    exp_avg_sq_[u].zero_();
  }
  step_ = optimizer.empty() ? 0 : optimizer.begin()->second.step;
  for (const auto& [name, s] : optimizer) {
    auto it = places_.find(name);
    if (it == places_.end()) throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
    if (s.step != step_) {
      throw std::invalid_argument("optimizer state: " + name + " took " + std::to_string(s.step) + " steps, other parameters " +
                                  std::to_string(step_) + "; --zero_stage 3 steps every parameter together");
    }
    const auto [u, k] = it->second;
    units_.copy_into_chunk(u, k, s.exp_avg, exp_avg_[u]);
    units_.copy_into_chunk(u, k, s.exp_avg_sq, exp_avg_sq_[u]);
  }
  if (!optimizer.empty() && optimizer.size() != places_.size()) {
    for (const auto& [name, place] : places_) {
      if (!optimizer.count(name)) throw std::invalid_argument("optimizer state: none for " + name + ", which --zero_stage 3 steps");
    }
  }
}

model::NamedTensors Zero3AdamW::unsplit_gradients() {
  std::vector<at::Tensor> gradients;
  for (size_t u = 0; u < units_.size(); ++u) gradients.push_back(units_.gradient_chunk(u));
  model::NamedTensors out;
  for_each_full(gradients, [&](const std::string& name, const at::Tensor& g) {
    out.emplace_back(name, g.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous());
  });
  return out;
}

}  // namespace

std::vector<dp::ShardedUnit> gpt2_units(model::GPT2LMHeadModel& model) {
  const int64_t L = model->config().n_layer;
  std::vector<dp::ShardedUnit> units(static_cast<size_t>(L + 1));
  units[0].name = "embeddings, ln_f and the tied head";
  for (int64_t i = 0; i < L; ++i) units[static_cast<size_t>(i + 1)].name = "h." + std::to_string(i);
  const std::string blocks = "transformer.h.";
  for (const auto& item : model->named_parameters()) {
    size_t u = 0;
    if (item.key().rfind(blocks, 0) == 0) u = static_cast<size_t>(std::stoll(item.key().substr(blocks.size()))) + 1;
    units.at(u).names.push_back(item.key());
    units.at(u).parameters.push_back(item.value());
    // One accumulation per backward each: autograd sums the tied wte's two uses (the embedding
    // and the head) before accumulating it, once, at the end of the backward.
    units.at(u).accumulations.push_back(1);
  }
  return units;
}

std::vector<size_t> zero3_use_order(int64_t n_layer) {
  std::vector<size_t> order{0};
  for (int64_t i = 1; i <= n_layer; ++i) order.push_back(static_cast<size_t>(i));
  order.push_back(0);
  for (int64_t i = n_layer; i >= 1; --i) order.push_back(static_cast<size_t>(i));
  return order;
}

Zero3Parts make_zero3(model::GPT2LMHeadModel model, const dp::DistContext& data, const OptimizerSettings& settings,
                      int prefetch) {
  if (prefetch < 0) throw std::invalid_argument("--zero_prefetch " + std::to_string(prefetch) + " must be >= 0");
  if (model->tensor_parallel() != nullptr) {
    throw std::invalid_argument("--zero_stage 3 shards whole units over the data-parallel ranks: it does not combine "
                                "with --tensor_parallel_size (use --zero_stage 1 or 2)");
  }
  Zero3Parts parts;
  parts.units = std::make_unique<dp::ShardedUnits>(data, gpt2_units(model));
  parts.forward_backward = std::make_unique<Zero3ForwardBackward>(model, *parts.units, prefetch);
  parts.optimizer = std::make_unique<Zero3AdamW>(model, settings, *parts.units);
  return parts;
}

}  // namespace harness::train
