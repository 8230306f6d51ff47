// --zero_stage 3's step parts (see zero3_step.h).
#include "harness/zero/zero3_step.h"

#include "harness/zero/moments.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "harness/model/precision.h"

namespace harness::zero {
namespace {

using train::ForwardBackward;
using train::WrappedForwardBackward;

class Zero3ForwardBackward final : public ForwardBackward {
 public:
  Zero3ForwardBackward(model::GPT2LMHeadModel model, ShardedUnits& units, int prefetch)
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
      loss = model_->head_loss(hidden, batch.labels, batch.label_token_weights, weight_sum);
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
  ShardedUnits& units_;
  int prefetch_;
  std::vector<size_t> order_;
};

class GatheredStages final : public WrappedForwardBackward {
 public:
  GatheredStages(std::unique_ptr<ForwardBackward> stages, ShardedUnits& units)
      : WrappedForwardBackward(std::move(stages), "gathered_stages"), units_(units) {}

  at::Tensor run(const data::Batch& batch, const at::Tensor& weight_sum, int64_t k,
                 model::Precision precision) override {
    // Every all-gather started at once, then each waited for: the first stage's first units are
    // ready soonest, and the later stages wait for activations anyway.
    for (size_t u = 0; u < units_.size(); ++u) units_.gather(u);
    for (size_t u = 0; u < units_.size(); ++u) units_.wait(u);
    return inner().run(batch, weight_sum, k, precision);
  }
  std::optional<double> validation_loss(data::BatchLoader& loader) override {
    Everything gathered(units_);
    return inner().validation_loss(loader);
  }
  std::optional<std::vector<std::string>> generate(const data::Tokenizer& tokenizer,
                                                   const std::vector<data::TranslationExample>& examples,
                                                   int64_t model_max_length, bool show_progress) override {
    Everything gathered(units_);
    return inner().generate(tokenizer, examples, model_max_length, show_progress);
  }

 private:
  // Every unit gathered for an evaluation, let go after it (an error too).
  struct Everything {
    explicit Everything(ShardedUnits& units) : units(units) { units.gather_all(); }
    ~Everything() { units.release_all(); }
    Everything(const Everything&) = delete;
    Everything& operator=(const Everything&) = delete;
    ShardedUnits& units;
  };

  ShardedUnits& units_;
};

const char* const kTiedWte = "transformer.wte.weight";

// The block a parameter belongs to ("transformer.h.3.attn.c_attn.weight" -> 3); none outside the blocks.
std::optional<int64_t> block_of(const std::string& name) {
  const std::string blocks = "transformer.h.";
  if (name.rfind(blocks, 0) != 0) return std::nullopt;
  return std::stoll(name.substr(blocks.size()));
}

}  // namespace

std::vector<ShardedUnit> stage_units(model::GPT2LMHeadModel& model, const std::vector<std::string>& held) {
  std::vector<ShardedUnit> units;
  std::map<std::string, size_t> unit_of;  // a unit's name -> its place, in the order first met
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    if (std::find(held.begin(), held.end(), name) == held.end()) continue;
    std::string unit = "wpe and ln_f";
    if (name == kTiedWte) {
      unit = kTiedWte;
    } else if (const std::optional<int64_t> block = block_of(name)) {
      unit = "h." + std::to_string(*block);
    }
    auto [it, added] = unit_of.emplace(unit, units.size());
    if (added) units.push_back({unit, {}, {}, {}});
    ShardedUnit& u = units[it->second];
    u.names.push_back(name);
    u.parameters.push_back(item.value());
    u.accumulations.push_back(1);
  }
  if (units.empty()) throw std::invalid_argument("--zero_stage 3: this process's pipeline stages hold no parameter");
  return units;
}

std::optional<size_t> tied_wte_unit(const ShardedUnits& units) {
  for (size_t u = 0; u < units.size(); ++u) {
    if (units.unit(u).name == kTiedWte) return u;
  }
  return std::nullopt;
}

std::unique_ptr<ForwardBackward> gathered_stages(std::unique_ptr<ForwardBackward> stages, ShardedUnits& units) {
  return std::make_unique<GatheredStages>(std::move(stages), units);
}

std::vector<ShardedUnit> gpt2_units(model::GPT2LMHeadModel& model) {
  const int64_t L = model->config().n_layer;
  std::vector<ShardedUnit> units(static_cast<size_t>(L + 1));
  units[0].name = "embeddings, ln_f and the tied head";
  for (int64_t i = 0; i < L; ++i) units[static_cast<size_t>(i + 1)].name = "h." + std::to_string(i);
  for (const auto& item : model->named_parameters()) {
    const std::optional<int64_t> block = block_of(item.key());
    const size_t u = block ? static_cast<size_t>(*block) + 1 : 0;
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

train::StepParts make_zero3(model::GPT2LMHeadModel model, const DistContext& data,
                             const train::OptimizerSettings& settings, int prefetch) {
  auto units = std::make_unique<ShardedUnits>(data, gpt2_units(model));
  train::StepParts parts;
  parts.forward_backward = std::make_unique<Zero3ForwardBackward>(model, *units, prefetch);
  parts.optimizer = train::whole_model_adamw(model, settings, unit_state(settings, *units));
  parts.sync = std::move(units);
  return parts;
}

}  // namespace harness::zero
