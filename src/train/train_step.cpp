// The training steps of each layout (see train_step.h).
#include "harness/train/train_step.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <map>
#include <optional>

#include "harness/data_parallel/grad_sync.h"
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


// ----- one GPT-2 (single device, model parallel, pipeline, data parallel) ---------------------

GPT2TrainStep::GPT2TrainStep(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer,
                             data_parallel::GradientSynchronizer* synchronizer)
    : model_(std::move(model)), optimizer_(replicated_adamw(model_, optimizer)), synchronizer_(synchronizer) {
  if (synchronizer_) synchronizer_->attach(*model_);
}

GPT2TrainStep::GPT2TrainStep(model::GPT2LMHeadModel model, std::unique_ptr<StepOptimizer> optimizer,
                             data_parallel::GradientSynchronizer* synchronizer)
    : model_(std::move(model)), optimizer_(std::move(optimizer)), synchronizer_(synchronizer) {
  if (!optimizer_) throw std::invalid_argument("GPT2TrainStep: no optimizer given");
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
