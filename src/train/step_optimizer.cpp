// The optimizer parts of a training step (see step_optimizer.h).
#include "harness/train/step_optimizer.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <map>
#include <optional>
#include <stdexcept>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/zero.h"
#include "harness/model/safetensors.h"
#include "harness/optim/fused_adamw.h"

namespace harness::train {
namespace {

// AdamW on the parameters this rank holds: the whole model, or its slices of a split one (each
// rank steps its shards; the state is gathered unsplit for checkpoints).
class ReplicatedAdamW final : public StepOptimizer {
 public:
  ReplicatedAdamW(model::GPT2LMHeadModel model, double learning_rate)
      : model_(std::move(model)),
        optimizer_(std::make_unique<optim::FusedAdamW>(model_->parameters(),
                                                       torch::optim::AdamWOptions(learning_rate))) {}

  void zero_grad() override { optimizer_->zero_grad(); }
  void step() override { optimizer_->step(); }
  bool collective_state() const override { return model_->tensor_parallel() != nullptr; }

  OptimizerState state() override;
  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override;
  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override;
  model::NamedTensors unsplit_gradients() override { return model_->full_gradients(); }

  int64_t state_bytes() const override {
    int64_t bytes = 0;
    for (const auto& [key, state] : optimizer_->state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
      bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
    }
    return bytes;
  }

 private:
  model::GPT2LMHeadModel model_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

// ZeRO-1: AdamW's moments for this rank's chunks of every gradient bucket (data_parallel/zero.h).
class ShardedAdamWOptimizer final : public StepOptimizer {
 public:
  ShardedAdamWOptimizer(model::GPT2LMHeadModel model, double learning_rate, data_parallel::BucketedAllReduce& gradients)
      : model_(std::move(model)), gradients_(gradients) {
    gradients_.attach(*model_);
    data_parallel::AdamWHyperparameters options;
    options.lr = learning_rate;
    adam_ = std::make_unique<data_parallel::ShardedAdamW>(gradients_, model_->parameters(), options);
  }

  void zero_grad() override {
    for (auto& p : model_->parameters()) p.mutable_grad() = at::Tensor();
  }
  void step() override { adam_->step(); }
  bool collective_state() const override { return true; }

  OptimizerState state() override;

  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override {
    model::write_model_weights(*model_, weights_path, write);
    const OptimizerState optimizer = state();  // collective: every rank gathers
    if (write) write_optimizer_state(optimizer_path, optimizer);
  }

  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override;
  model::NamedTensors unsplit_gradients() override;
  int64_t state_bytes() const override { return adam_->state_bytes(); }

 private:
  model::GPT2LMHeadModel model_;
  data_parallel::BucketedAllReduce& gradients_;
  std::unique_ptr<data_parallel::ShardedAdamW> adam_;
};

OptimizerState ReplicatedAdamW::state() {
  OptimizerState state = capture_adamw_state(*optimizer_, named_parameters_of(*model_));
  if (model_->tensor_parallel() == nullptr) return state;
  // Every rank of the group walks the parameters in the same order and has state for the same
  // ones (all train every parameter), so the gathers match across the group.
  OptimizerState full;
  for (const auto& item : model_->named_parameters()) {
    auto it = state.find(item.key());
    if (it == state.end()) continue;
    full[item.key()] = {it->second.step, model_->unshard(item.key(), it->second.exp_avg),
                        model_->unshard(item.key(), it->second.exp_avg_sq)};
  }
  return full;
}

void ReplicatedAdamW::save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) {
  model::write_model_weights(*model_, weights_path, write);  // a collective when the model is split
  if (model_->tensor_parallel() == nullptr) {
    if (write) write_optimizer_state(optimizer_path, state());
    return;
  }
  // Split: each unsplit moment is gathered (a collective over the group), written by the writer
  // and dropped before the next; every rank walks the same parameters in the same order.
  std::vector<std::pair<std::string, const torch::optim::AdamWParamState*>> with_state;
  std::vector<OptimizerStateWriter::Parameter> parameters;
  auto& states = optimizer_->state();
  for (const auto& item : model_->named_parameters()) {
    auto it = states.find(item.value().unsafeGetTensorImpl());
    if (it == states.end()) continue;
    const auto* s = static_cast<const torch::optim::AdamWParamState*>(it->second.get());
    with_state.emplace_back(item.key(), s);
    parameters.push_back({item.key(), s->step(), model_->shards().at(item.key()).full_shape});
  }
  std::optional<OptimizerStateWriter> file;
  if (write) file.emplace(optimizer_path, parameters);
  for (const auto& [name, s] : with_state) {
    const at::Tensor exp_avg = model_->unshard(name, s->exp_avg()), exp_avg_sq = model_->unshard(name, s->exp_avg_sq());
    if (file) file->add(exp_avg, exp_avg_sq);
  }
  if (file) file->finish();
}

void ReplicatedAdamW::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
  model_->load_full_state(weights);
  OptimizerState local;
  for (const auto& [name, s] : optimizer) {
    if (!model_->shards().count(name)) {
      throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
    }
    local[name] = {s.step, model_->shard(name, s.exp_avg), model_->shard(name, s.exp_avg_sq)};
  }
  restore_adamw_state(*optimizer_, named_parameters_of(*model_), local);
}

OptimizerState ShardedAdamWOptimizer::state() {
  const data_parallel::ShardedAdamW::FullState full = adam_->gather_state();  // collective
  OptimizerState out;
  if (full.moments.empty()) return out;
  const NamedParameters named = named_parameters_of(*model_);
  for (size_t i = 0; i < named.size(); ++i) {
    if (!full.moments[i].first.defined()) continue;
    out[named[i].first] = {full.step, full.moments[i].first.to(torch::kFloat), full.moments[i].second.to(torch::kFloat)};
  }
  return out;
}

void ShardedAdamWOptimizer::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
  model_->load_full_state(weights);
  const NamedParameters named = named_parameters_of(*model_);
  data_parallel::ShardedAdamW::FullState full;
  if (!optimizer.empty()) {
    std::map<std::string, size_t> index_of;
    for (size_t i = 0; i < named.size(); ++i) index_of[named[i].first] = i;
    full.moments.resize(named.size());
    full.step = optimizer.begin()->second.step;
    // Every entry is checked on every rank (not only the chunks this rank keeps), so that a bad
    // checkpoint fails on all ranks alike instead of leaving some to wait.
    for (const auto& [name, state] : optimizer) {
      auto it = index_of.find(name);
      if (it == index_of.end()) throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
      if (state.step != full.step) {
        throw std::invalid_argument("optimizer state: " + name + " took " + std::to_string(state.step) +
                                    " steps, other parameters " + std::to_string(full.step) +
                                    "; --zero_stage 1 steps every parameter together");
      }
      for (const at::Tensor* moment : {&state.exp_avg, &state.exp_avg_sq}) {
        if (!moment->defined() || moment->sizes() != named[it->second].second.sizes()) {
          throw std::invalid_argument("optimizer state of " + name + " does not have the parameter's shape");
        }
      }
      full.moments[it->second] = {state.exp_avg, state.exp_avg_sq};
    }
    for (size_t i = 0; i < named.size(); ++i) {
      if (named[i].second.requires_grad() && !full.moments[i].first.defined()) {
        throw std::invalid_argument("optimizer state: none for " + named[i].first + ", which --zero_stage 1 steps");
      }
    }
  }
  adam_->load_state(full);
}

model::NamedTensors ShardedAdamWOptimizer::unsplit_gradients() {
  // The averaged gradient exists only as the ranks' chunks: all-gathered here (collective).
  torch::NoGradGuard no_grad;
  const NamedParameters named = named_parameters_of(*model_);
  std::vector<at::Tensor> full(named.size());
  const auto& plan = gradients_.bucket_plan();
  for (size_t b = 0; b < plan.size(); ++b) {
    const std::vector<at::Tensor> parts = gradients_.gather_bucket(b, gradients_.gradient_shard(b));
    for (size_t k = 0; k < parts.size(); ++k) full[plan[b][k]] = parts[k].to(torch::kCPU).contiguous();
  }
  model::NamedTensors out;
  for (size_t i = 0; i < named.size(); ++i) {
    if (full[i].defined()) out.emplace_back(named[i].first, full[i]);
  }
  return out;
}

}  // namespace

std::unique_ptr<StepOptimizer> replicated_adamw(model::GPT2LMHeadModel model, double learning_rate) {
  return std::make_unique<ReplicatedAdamW>(std::move(model), learning_rate);
}

std::unique_ptr<StepOptimizer> sharded_adamw(model::GPT2LMHeadModel model, double learning_rate,
                                             data_parallel::BucketedAllReduce& gradients) {
  return std::make_unique<ShardedAdamWOptimizer>(std::move(model), learning_rate, gradients);
}

}  // namespace harness::train
