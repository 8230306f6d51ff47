// The training steps of each layout (see train_step.h).
#include "harness/train/train_step.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <map>
#include <optional>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/zero.h"
#include "harness/optim/fused_adamw.h"
#include "harness/trace.h"
#include "harness/model/loss.h"
#include "harness/train/loss.h"

namespace harness::train {
namespace {

// The part every layout shares: each batch's forward (`logits_of`) and backward, the losses
// weighted over all batches, the synchronisation once after the last backward (no_sync before),
// the hook, the optimizer step.
// `zero_grad` and `optimizer_step` are the optimizer's (AdamW's, or ZeRO's sharded one).
double accumulate_and_step(const std::vector<data::Batch>& batches,
                           const std::function<at::Tensor(const at::Tensor&)>& logits_of, model::Precision precision,
                           const std::function<void()>& zero_grad, const std::function<void()>& optimizer_step,
                           data_parallel::GradientSynchronizer* synchronizer,
                           const std::function<void()>& after_backward, Tracer* tracer, const std::string& track) {
  if (batches.empty()) throw std::invalid_argument("a training step needs at least one batch");
  zero_grad();
  at::Tensor total;
  at::Tensor weight_sum;
  for (size_t k = 0; k < batches.size(); ++k) {
    if (synchronizer) synchronizer->set_no_sync(k + 1 < batches.size());
    const data::Batch& batch = batches[k];
    at::Tensor loss;
    {
      model::AutocastScope autocast(precision, batch.input_ids.device().type());
      const at::Tensor logits = logits_of(batch.input_ids);
      const at::Tensor labels = batch.labels.to(logits.device());
      const at::Tensor weights = batch.label_token_weights.to(logits.device());
      if (batches.size() == 1) {
        loss = model::weighted_cross_entropy(logits, labels, weights);
      } else {
        if (!weight_sum.defined()) weight_sum = combined_label_weight(batches, logits.device());
        loss = model::weighted_cross_entropy(logits, labels, weights, weight_sum);
      }
    }
    loss.backward();
    total = total.defined() ? total + loss.detach() : loss.detach();
  }
  if (synchronizer) {
    TraceScope scope(tracer, "gradient all-reduce", track);
    synchronizer->finalize();
  }
  if (after_backward) after_backward();
  optimizer_step();
  // Reading the loss also waits for the step, so a step's time is finished work on every device.
  return total.item<double>();
}

}  // namespace

void TrainStep::save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) {
  model::write_model_weights(*model(), weights_path, write);  // a collective when the model is split
  OptimizerState optimizer;
  if (write || collective_state()) optimizer = optimizer_state();
  if (write) write_optimizer_state(optimizer_path, optimizer);
}

NamedParameters named_parameters_of(torch::nn::Module& module) {
  NamedParameters out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

// ----- one GPT-2 (single device, model parallel, pipeline, data parallel) ---------------------

GPT2TrainStep::GPT2TrainStep(model::GPT2LMHeadModel model, double learning_rate,
                             data_parallel::GradientSynchronizer* synchronizer)
    : model_(std::move(model)),
      optimizer_(std::make_unique<optim::FusedAdamW>(model_->parameters(),
                                                     torch::optim::AdamWOptions(learning_rate))),
      synchronizer_(synchronizer) {
  if (synchronizer_) synchronizer_->attach(*model_);
}

GPT2TrainStep::~GPT2TrainStep() = default;

double GPT2TrainStep::step(const std::vector<data::Batch>& batches) {
  return accumulate_and_step(
      batches, [this](const at::Tensor& ids) { return model_->forward(ids); }, precision,
      [this] { optimizer_->zero_grad(); }, [this] { optimizer_->step(); }, synchronizer_, after_backward, tracer,
      trace_track);
}

c10::Device GPT2TrainStep::input_device() const { return model_->first_device().torch_device(); }

void GPT2TrainStep::set_training(bool training) { model_->train(training); }

OptimizerState GPT2TrainStep::optimizer_state() {
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

void GPT2TrainStep::save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) {
  if (model_->tensor_parallel() == nullptr) {
    TrainStep::save_state(weights_path, optimizer_path, write);
    return;
  }
  // Split: each unsplit tensor is gathered (a collective over the group), written by the writer
  // and dropped before the next; every rank walks the same parameters in the same order.
  model::write_model_weights(*model_, weights_path, write);
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

void GPT2TrainStep::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
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

model::NamedTensors GPT2TrainStep::unsplit_gradients() { return model_->full_gradients(); }

GeneratorStates GPT2TrainStep::extra_generator_states() {
  GeneratorStates out;
  if (model_->tensor_parallel() == nullptr) return out;
  for (const auto& [device, state] : model_->tensor_parallel()->rank_stream_states()) {
    out["tensor_parallel_attention:" + device] = tensor_to_bytes(state);
  }
  return out;
}

void GPT2TrainStep::restore_extra_generator_states(const GeneratorStates& states) {
  if (model_->tensor_parallel() == nullptr) return;
  const std::string prefix = "tensor_parallel_attention:";
  std::map<std::string, at::Tensor> streams;
  for (const auto& [name, bytes] : states) {
    if (name.rfind(prefix, 0) == 0) streams[name.substr(prefix.size())] = bytes_to_tensor(bytes);
  }
  model_->tensor_parallel()->set_rank_stream_states(streams);
}

}  // namespace harness::train

// ----- ZeRO-1 ------------------------------------------------------------------------------------

namespace harness::train {

ZeroTrainStep::ZeroTrainStep(model::GPT2LMHeadModel model, double learning_rate,
                             data_parallel::BucketedAllReduce* gradients)
    : model_(std::move(model)), gradients_(gradients) {
  if (gradients_ == nullptr) throw std::invalid_argument("ZeroTrainStep needs a reduce-scattering synchronizer");
  gradients_->attach(*model_);
  data_parallel::AdamWHyperparameters options;
  options.lr = learning_rate;
  adam_ = std::make_unique<data_parallel::ShardedAdamW>(*gradients_, model_->parameters(), options);
}

ZeroTrainStep::~ZeroTrainStep() = default;

double ZeroTrainStep::step(const std::vector<data::Batch>& batches) {
  return accumulate_and_step(
      batches, [this](const at::Tensor& ids) { return model_->forward(ids); }, precision,
      [this] {
        for (auto& p : model_->parameters()) p.mutable_grad() = at::Tensor();
      },
      [this] { adam_->step(); }, gradients_, after_backward, tracer, trace_track);
}

c10::Device ZeroTrainStep::input_device() const { return model_->first_device().torch_device(); }

void ZeroTrainStep::set_training(bool training) { model_->train(training); }

OptimizerState ZeroTrainStep::optimizer_state() {
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

void ZeroTrainStep::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
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

model::NamedTensors ZeroTrainStep::unsplit_gradients() {
  // The averaged gradient exists only as the ranks' chunks: all-gathered here (collective).
  torch::NoGradGuard no_grad;
  const NamedParameters named = named_parameters_of(*model_);
  std::vector<at::Tensor> full(named.size());
  const auto& plan = gradients_->bucket_plan();
  for (size_t b = 0; b < plan.size(); ++b) {
    const std::vector<at::Tensor> parts = gradients_->gather_bucket(b, gradients_->gradient_shard(b));
    for (size_t k = 0; k < parts.size(); ++k) full[plan[b][k]] = parts[k].to(torch::kCPU).contiguous();
  }
  model::NamedTensors out;
  for (size_t i = 0; i < named.size(); ++i) {
    if (full[i].defined()) out.emplace_back(named[i].first, full[i]);
  }
  return out;
}

}  // namespace harness::train
