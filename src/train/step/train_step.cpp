// The training steps of each layout (see train_step.h).
#include "harness/train/step/train_step.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <optional>

#include "harness/data_parallel/grad_sync.h"
#include "harness/pipeline/activation_meter.h"
#include "harness/trace.h"
#include "harness/model/loss.h"
#include "harness/train/loss.h"
#include "harness/train/run/trainer.h"

namespace harness::train {
GPT2TrainStep::GPT2TrainStep(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer,
                             data_parallel::GradientSynchronizer* synchronizer, TrainStepSettings settings)
    : model_(std::move(model)),
      forward_backward_(whole_model(model_)),
      optimizer_(replicated_adamw(model_, optimizer)),
      synchronizer_(synchronizer),
      settings_(std::move(settings)) {
  if (synchronizer_) synchronizer_->attach(*model_);
}

GPT2TrainStep::GPT2TrainStep(model::GPT2LMHeadModel model, std::unique_ptr<ForwardBackward> forward_backward,
                             std::unique_ptr<StepOptimizer> optimizer,
                             data_parallel::GradientSynchronizer* synchronizer, TrainStepSettings settings)
    : model_(std::move(model)),
      forward_backward_(std::move(forward_backward)),
      optimizer_(std::move(optimizer)),
      synchronizer_(synchronizer),
      settings_(std::move(settings)) {
  if (!forward_backward_) throw std::invalid_argument("GPT2TrainStep: no forward-backward given");
  if (!optimizer_) throw std::invalid_argument("GPT2TrainStep: no optimizer given");
}

GPT2TrainStep::~GPT2TrainStep() = default;

// Each batch's forward and backward (the losses weighted over all the batches), the
// synchronisation once, overlapping the last batch's backward passes (no_sync before it; a
// schedule's buckets start as their parameters' last micro-batch backward completes them), what
// the gradients still need, the hook, the optimizer step.
double GPT2TrainStep::step(const std::vector<data::Batch>& batches) { return step(batches, {}); }

double GPT2TrainStep::step(const std::vector<data::Batch>& batches, const std::vector<double>& loss_divisors) {
  if (batches.empty()) throw std::invalid_argument("a training step needs at least one batch");
  if (!loss_divisors.empty() && loss_divisors.size() != batches.size()) {
    throw std::invalid_argument("a training step of " + std::to_string(batches.size()) + " batches got " +
                                std::to_string(loss_divisors.size()) + " loss divisors");
  }
  ForwardBackward& run = *forward_backward_;
  optimizer_->zero_grad();
  // What the step allocates from here (activations, gradients) is what the CPU tensor counter's
  // window measures, where it is on.
  if (pipeline::activation_meter_installed()) pipeline::restart_cpu_tensor_window();
  const at::Tensor combined =
      batches.size() > 1 && loss_divisors.empty() ? combined_label_weight(batches, run.loss_device()) : at::Tensor();
  const auto weight_sum_of = [&](size_t k) {
    if (loss_divisors.empty()) return combined;
    return torch::tensor(static_cast<float>(loss_divisors[k]), torch::TensorOptions(torch::kFloat32).device(run.loss_device()));
  };
  at::Tensor total;
  const bool every_batch = synchronizer_ && synchronizer_->reduces_every_batch();
  for (size_t k = 0; k < batches.size(); ++k) {
    if (synchronizer_) {
      synchronizer_->set_no_sync(!every_batch && k + 1 < batches.size());
      synchronizer_->set_expected_accumulations(run.gradient_accumulations(batches[k]));
    }
    const at::Tensor loss = run.run(batches[k], weight_sum_of(k), static_cast<int64_t>(k), settings_.precision);
    if (loss.defined()) total = total.defined() ? total + loss : loss;
    if (every_batch && k + 1 < batches.size()) {  // ZeRO-2: into the shards, the gradients let go
      TraceScope scope(settings_.tracer, "gradient reduce-scatter", settings_.trace_track);
      synchronizer_->finalize();
    }
  }
  if (synchronizer_) {
    TraceScope scope(settings_.tracer, "gradient all-reduce", settings_.trace_track);
    synchronizer_->finalize();
  }
  run.finish_gradients();
  if (after_backward) after_backward();
  if (loss_before_update_) {
    // The loss's collective (a pipeline's last stage tells the others) before the commit vote: after
    // it, the step has no collective left.
    const double loss = run.step_loss(total);
    optimizer_->step();
    return loss;
  }
  optimizer_->step();
  // Reading the loss also waits for the step, so a step's time is finished work on every device.
  return run.step_loss(total);
}

void GPT2TrainStep::set_before_update(std::function<void()> hook) {
  loss_before_update_ = static_cast<bool>(hook);
  optimizer_->set_before_update(std::move(hook));
}

void TrainStep::save_model(const std::string& dir, bool write) {
  model::GPT2LMHeadModel gathered = gathered_model();
  if (write || gathered->tensor_parallel() != nullptr) model::save_pretrained(*gathered, dir, write);
}

void GPT2TrainStep::save_model(const std::string& dir, bool write) {
  if (write) std::filesystem::create_directories(dir);
  if (!optimizer_->stream_weights((std::filesystem::path(dir) / "model.safetensors").string(), write)) {
    TrainStep::save_model(dir, write);
    return;
  }
  if (write) model_->config().save_json_file((std::filesystem::path(dir) / "config.json").string());
}

double TrainStep::validation_loss(data::BatchLoader& loader) {
  model::GPT2LMHeadModel gathered = gathered_model();
  return evaluate_loss(gathered, loader, gathered->transformer->wte->weight.device());
}

std::vector<std::string> TrainStep::generate(const data::Tokenizer& tokenizer,
                                             const std::vector<data::TranslationExample>& examples,
                                             int64_t model_max_length, bool show_progress) {
  model::GPT2LMHeadModel gathered = gathered_model();
  return generate_translations(gathered, tokenizer, examples, model_max_length,
                               gathered->transformer->wte->weight.device(), show_progress);
}

double GPT2TrainStep::validation_loss(data::BatchLoader& loader) {
  if (std::optional<double> loss = forward_backward_->validation_loss(loader)) return *loss;
  return TrainStep::validation_loss(loader);
}

std::vector<std::string> GPT2TrainStep::generate(const data::Tokenizer& tokenizer,
                                                 const std::vector<data::TranslationExample>& examples,
                                                 int64_t model_max_length, bool show_progress) {
  if (auto generations = forward_backward_->generate(tokenizer, examples, model_max_length, show_progress)) {
    return *generations;
  }
  return TrainStep::generate(tokenizer, examples, model_max_length, show_progress);
}

c10::Device GPT2TrainStep::input_device() const { return forward_backward_->input_device(); }

void GPT2TrainStep::set_training(bool training) { model_->train(training); }

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
