// The training steps of each layout (see train_step.h).
#include "harness/train/train_step.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "harness/data_parallel/grad_sync.h"
#include "harness/tensor_parallel/comm_ops.h"
#include "harness/tensor_parallel/gpt2_tensor_parallel.h"
#include "harness/tensor_parallel/layers.h"
#include "harness/trace.h"
#include "harness/train/loss.h"

namespace harness::train {
namespace {

namespace tp = harness::tensor_parallel;

// backward, synchronisation, hook, optimizer step: the part every layout shares.
double finish_step(const at::Tensor& loss, torch::optim::AdamW& optimizer,
                   data_parallel::GradientSynchronizer* synchronizer,
                   const std::function<void()>& after_backward, Tracer* tracer,
                   const std::string& track) {
  loss.backward();
  if (synchronizer) {
    TraceScope scope(tracer, "gradient all-reduce", track);
    synchronizer->finalize();
  }
  if (after_backward) after_backward();
  optimizer.step();
  // Reading the loss also waits for the step, so a step's time is finished work on every device.
  return loss.item<double>();
}

at::Tensor loss_of(const at::Tensor& logits, const data::Batch& batch) {
  return weighted_cross_entropy(logits, batch.labels.to(logits.device()),
                                batch.label_token_weights.to(logits.device()));
}

void load_weights(torch::nn::Module& module, const model::NamedTensors& weights) {
  auto parameters = module.named_parameters();
  torch::NoGradGuard no_grad;
  for (const auto& [name, tensor] : weights) {
    at::Tensor* p = parameters.find(name);
    if (p == nullptr) throw std::invalid_argument("weights for " + name + ", which the model does not have");
    if (p->sizes() != tensor.sizes()) {
      throw std::invalid_argument("weights of " + name + " have another shape than the model's");
    }
    p->copy_(tensor.to(p->device(), p->scalar_type()));
  }
  if (weights.size() != parameters.size()) {
    throw std::invalid_argument(std::to_string(parameters.size() - weights.size()) +
                                " of the model's parameters have no weights");
  }
}

}  // namespace

NamedParameters named_parameters_of(torch::nn::Module& module) {
  NamedParameters out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

// ----- one GPT-2 (single device, model parallel, pipeline, data parallel) ---------------------

GPT2TrainStep::GPT2TrainStep(model::GPT2LMHeadModel model, double learning_rate,
                             data_parallel::GradientSynchronizer* synchronizer)
    : model_(std::move(model)),
      optimizer_(std::make_unique<torch::optim::AdamW>(model_->parameters(),
                                                       torch::optim::AdamWOptions(learning_rate))),
      synchronizer_(synchronizer) {
  if (synchronizer_) synchronizer_->attach(*model_);
}

GPT2TrainStep::~GPT2TrainStep() = default;

double GPT2TrainStep::step(const data::Batch& batch) {
  optimizer_->zero_grad();
  const at::Tensor logits = model_->forward(batch.input_ids);
  return finish_step(loss_of(logits, batch), *optimizer_, synchronizer_, after_backward, tracer,
                     trace_track);
}

c10::Device GPT2TrainStep::input_device() const { return model_->first_device().torch_device(); }

void GPT2TrainStep::set_training(bool training) { model_->train(training); }

OptimizerState GPT2TrainStep::optimizer_state() {
  return capture_adamw_state(*optimizer_, named_parameters_of(*model_));
}

void GPT2TrainStep::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
  load_weights(*model_, weights);
  restore_adamw_state(*optimizer_, named_parameters_of(*model_), optimizer);
}

model::NamedTensors GPT2TrainStep::unsplit_gradients() {
  model::NamedTensors out;
  for (const auto& item : model_->named_parameters()) {
    if (item.value().grad().defined()) {
      out.emplace_back(item.key(), item.value().grad().detach().to(torch::kCPU).contiguous());
    }
  }
  return out;
}

// ----- tensor parallel -------------------------------------------------------------------------

TensorParallelTrainStep::TensorParallelTrainStep(std::shared_ptr<tp::TensorParallelGPT2LMHeadModelImpl> split,
                                                 model::GPT2LMHeadModel full, double learning_rate,
                                                 data_parallel::GradientSynchronizer* synchronizer)
    : split_(std::move(split)),
      full_(std::move(full)),
      optimizer_(std::make_unique<torch::optim::AdamW>(split_->parameters(),
                                                       torch::optim::AdamWOptions(learning_rate))),
      synchronizer_(synchronizer) {
  if (synchronizer_) synchronizer_->attach(*split_);
}

TensorParallelTrainStep::~TensorParallelTrainStep() = default;

double TensorParallelTrainStep::step(const data::Batch& batch) {
  optimizer_->zero_grad();
  const at::Tensor logits = split_->forward(batch.input_ids);
  return finish_step(loss_of(logits, batch), *optimizer_, synchronizer_, after_backward, tracer,
                     trace_track);
}

c10::Device TensorParallelTrainStep::input_device() const {
  return split_->transformer->wte->weight.device();
}

void TensorParallelTrainStep::set_training(bool training) {
  split_->train(training);
  full_->train(training);
}

model::GPT2LMHeadModel TensorParallelTrainStep::unsplit_model() {
  split_->copy_into(*full_);  // collective over the tensor-parallel group
  return full_;
}

OptimizerState TensorParallelTrainStep::optimizer_state() {
  const OptimizerState local = capture_adamw_state(*optimizer_, named_parameters_of(*split_));
  const data_parallel::DistContext& group = split_->tensor_context();
  OptimizerState full;
  // Every rank walks the parameters in the same order and has state for the same ones (they all
  // train every parameter), so the gathers below match across the group.
  for (const auto& item : split_->named_parameters()) {
    auto it = local.find(item.key());
    if (it == local.end()) continue;
    const tp::ShardSpec& spec = split_->shards().at(item.key()).spec;
    auto unsplit = [&](const at::Tensor& shard) {
      if (spec.kind == tp::ShardSpec::Kind::kReplicated) return shard;
      const at::Tensor on_device = shard.to(item.value().device());
      return tp::unshard_tensor(tp::all_gather(on_device, group), spec).to(torch::kCPU).contiguous();
    };
    full[item.key()] = {it->second.step, unsplit(it->second.exp_avg), unsplit(it->second.exp_avg_sq)};
  }
  return full;
}

void TensorParallelTrainStep::load_state(const model::NamedTensors& weights,
                                         const OptimizerState& optimizer) {
  split_->load_full_state(weights);
  const data_parallel::DistContext& group = split_->tensor_context();
  OptimizerState local;
  for (const auto& [name, s] : optimizer) {
    auto shard = split_->shards().find(name);
    if (shard == split_->shards().end()) {
      throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
    }
    local[name] = {s.step, tp::shard_tensor(s.exp_avg, shard->second.spec, group.rank, group.world_size),
                   tp::shard_tensor(s.exp_avg_sq, shard->second.spec, group.rank, group.world_size)};
  }
  restore_adamw_state(*optimizer_, named_parameters_of(*split_), local);
}

model::NamedTensors TensorParallelTrainStep::unsplit_gradients() {
  return split_->gather_full_gradients();
}

GeneratorStates TensorParallelTrainStep::extra_generator_states() {
  GeneratorStates out;
  for (const auto& [device, state] : split_->transformer->rng().states()) {
    out["tensor_parallel_attention:" + device] = tensor_to_bytes(state);
  }
  return out;
}

void TensorParallelTrainStep::restore_extra_generator_states(const GeneratorStates& states) {
  const std::string prefix = "tensor_parallel_attention:";
  std::map<std::string, at::Tensor> streams;
  for (const auto& [name, bytes] : states) {
    if (name.rfind(prefix, 0) == 0) streams[name.substr(prefix.size())] = bytes_to_tensor(bytes);
  }
  split_->transformer->rng().set_states(streams);
}

}  // namespace harness::train
