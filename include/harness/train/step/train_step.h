// "One optimizer step on one batch", the seam between the training driver (driver.h) and a
// parallel layout: the driver owns epochs, evaluation, reports and checkpoints; a step owns the
// model, the optimizer and whatever the layout needs (gradient synchronisation, a tensor-parallel
// group, a pipeline installed in the model). The driver never changes with the layout.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "harness/data/collate.h"
#include "harness/data/example.h"
#include "harness/data/loader.h"
#include "harness/data/tokenizer.h"
#include "harness/model/gpt2.h"
#include "harness/model/precision.h"
#include "harness/model/safetensors.h"
#include "harness/train/step/forward_backward.h"
#include "harness/train/step/step_optimizer.h"
#include "harness/train/checkpoint/training_state.h"

namespace torch::optim {
class Optimizer;
class AdamW;
}
namespace harness {
class Tracer;
}
namespace harness::data_parallel {
class GradientSynchronizer;
}

namespace harness::train {

class TrainStep {
 public:
  virtual ~TrainStep() = default;

  // One optimizer step over `batches` (gradient accumulation when there are several, as
  // --gradient_accumulation_steps): zero_grad, then each batch's forward, SPEC §3's loss and
  // backward in turn, every loss weighted by the label weight of all the batches together (so the
  // step equals one on the batches concatenated), the layout's gradient synchronisation once,
  // after the last backward (DDP's no_sync before it), then the optimizer step. Returns the loss
  // of the combined batch; the step's work is finished on return on every device type.
  virtual double step(const std::vector<data::Batch>& batches) = 0;
  // One optimizer step on one batch.
  double step(const data::Batch& batch) { return step(std::vector<data::Batch>{batch}); }
  // Where a batch's tensors must be before step() (the model's first device).
  virtual c10::Device input_device() const = 0;
  // train() or eval() on everything that trains.
  virtual void set_training(bool training) = 0;
  // The learning rate of the following steps (a schedule sets it before each one).
  virtual void set_learning_rate(double learning_rate) = 0;
  virtual double learning_rate() const = 0;
  // The global L2 norm of the whole model's gradient in the last step, as one device would
  // compute it, before any clipping (StepOptimizer::last_grad_norm).
  virtual double last_grad_norm() const = 0;

  // The model that trains, with the current weights: evaluation and generation run on it. Split
  // over a tensor-parallel group, its forward is a collective (every rank of the group runs the
  // same evaluation), and its full_state() gathers the unsplit weights for saving.
  virtual model::GPT2LMHeadModel model() = 0;
  // The model with every weight current on this rank, for evaluation, generation and the saved
  // model: model() itself, unless the layout keeps only some weights current on each process
  // (pipeline stages that are processes gather the others' here). A collective there, so every
  // rank calls it at the same points.
  virtual model::GPT2LMHeadModel gathered_model() { return model(); }
  // Evaluation (SPEC §3): the mean validation loss over `loader`'s batches, and greedy generation
  // for each example. By default gathered_model() evaluated as one model; pipeline stages that
  // are processes run it through the stages instead (forward only; in generation each stage keeps
  // its own layers' KV cache). A collective wherever the model is split, so every rank calls them.
  virtual double validation_loss(data::BatchLoader& loader);
  virtual std::vector<std::string> generate(const data::Tokenizer& tokenizer,
                                            const std::vector<data::TranslationExample>& examples,
                                            int64_t model_max_length, bool show_progress);

  // Checkpoints. The AdamW state under Hugging Face names, unsplit (collective for tensor
  // parallelism and ZeRO; every rank gets it).
  virtual OptimizerState optimizer_state() = 0;
  // Whether the model's full_state(), optimizer_state() or save_state() is a collective every
  // rank must call.
  virtual bool collective_state() const { return false; }
  // A checkpoint's state files: the unsplit weights as Hugging Face's model.safetensors at
  // `weights_path` and the AdamW state at `optimizer_path` (write_optimizer_state's format),
  // written where `write` (the checkpoint's writer; the paths are ignored elsewhere). A split model
  // streams each unsplit tensor into the files as it is gathered, so no rank holds the unsplit
  // state.
  virtual void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) = 0;
  // The trained model as Hugging Face's folder (config.json and model.safetensors) in `dir`,
  // written where `write`: gathered_model() saved, unless the layout streams the weights one piece
  // at a time (ZeRO-3). A collective where collective_state() or the model is split.
  virtual void save_model(const std::string& dir, bool write);
  // Unsplit weights and optimizer state in (each rank keeps its part). Errors name the tensor.
  virtual void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) = 0;
  // Generator streams the layout owns besides the default generators (tensor parallelism's
  // per-rank attention-dropout stream), as opaque bytes by name.
  virtual GeneratorStates extra_generator_states() { return {}; }
  virtual void restore_extra_generator_states(const GeneratorStates& states) {}
  // The gradients of the last backward, unsplit, Hugging Face names, on the CPU (--pytest's
  // files); parameters without a gradient are left out. Collective for tensor parallelism.
  virtual model::NamedTensors unsplit_gradients() = 0;
  // The optimizer steps taken before the next step() (the driver says so at start and after a
  // resume; each step() adds one). Layouts whose random streams derive from the step use it.
  virtual void set_global_step(int64_t global_step) {}

  // A hook, not a setting: runs after backward and the gradient synchronisation, before the
  // optimizer step (the driver installs one around a step whose gradients it writes).
  std::function<void()> after_backward;
};

// How a GPT2TrainStep runs its steps, given at construction.
struct TrainStepSettings {
  // --precision: the forward passes (and the loss) of step() run under autocast in it.
  model::Precision precision = model::Precision::kFp32;
  Tracer* tracer = nullptr;  // records the gradient synchronisation when set
  std::string trace_track = "main";
};

// GPT-2's training step, made of three parts chosen once by the layout (never subclassed):
//   - how forward and backward run (forward_backward.h): the whole model on this process (one
//     device, model parallel over devices by its own placement, or split over a tensor-parallel
//     group, Megatron style), or a pipeline schedule over stages on this process's threads or on
//     the stages' processes;
//   - how gradients are synchronised (data_parallel/grad_sync.h): averaged over the data-parallel
//     group between backward and the optimizer step, or not at all;
//   - how the optimizer steps (step_optimizer.h): AdamW on what this rank holds, ZeRO-1's sharded
//     AdamW, or a pipeline stage's AdamW; it also knows where the state lives, for checkpoints that
//     always hold the unsplit state.
// Its settings (precision, tracer) are given at construction; `after_backward` (e.g. --pytest's
// gradient files) runs after the synchronisation.
class GPT2TrainStep : public TrainStep {
 public:
  // The whole model's forward and replicated AdamW; `synchronizer` (if any) is attached to the
  // model here.
  GPT2TrainStep(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer,
                data_parallel::GradientSynchronizer* synchronizer = nullptr, TrainStepSettings settings = {});
  // The parts as built for `model`: `synchronizer` (if any) already attached to the parameters it
  // averages (sharded_adamw attaches the reduce-scattering synchronizer it is built on).
  GPT2TrainStep(model::GPT2LMHeadModel model, std::unique_ptr<ForwardBackward> forward_backward,
                std::unique_ptr<StepOptimizer> optimizer, data_parallel::GradientSynchronizer* synchronizer,
                TrainStepSettings settings = {});
  ~GPT2TrainStep() override;
  GPT2TrainStep(const GPT2TrainStep&) = delete;
  GPT2TrainStep& operator=(const GPT2TrainStep&) = delete;

  using TrainStep::step;
  double step(const std::vector<data::Batch>& batches) override;
  // step(), each batch's loss divided by loss_divisors[k] instead of the label weight of all the
  // batches together (an elastic generation's member: each batch's own replica's weight, scaled;
  // train/elastic/elastic_batches.h). Empty: step(batches).
  double step(const std::vector<data::Batch>& batches, const std::vector<double>& loss_divisors);
  // Elastic training's commit vote (data_parallel/elastic_rendezvous.h): `hook` runs in each step
  // once every collective of it is done (the loss read first, then the global norm), before the
  // optimizer changes anything; where it throws, the step changes nothing. Empty: none.
  void set_before_update(std::function<void()> hook);
  c10::Device input_device() const override;
  void set_training(bool training) override;
  void set_learning_rate(double learning_rate) override { optimizer_->set_learning_rate(learning_rate); }
  double learning_rate() const override { return optimizer_->learning_rate(); }
  double last_grad_norm() const override { return optimizer_->last_grad_norm(); }
  model::GPT2LMHeadModel model() override { return model_; }
  model::GPT2LMHeadModel gathered_model() override {
    optimizer_->gather_weights();
    return model_;
  }
  OptimizerState optimizer_state() override { return optimizer_->state(); }
  bool collective_state() const override { return optimizer_->collective_state(); }
  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override {
    optimizer_->save_state(weights_path, optimizer_path, write);
  }
  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override {
    optimizer_->load_state(weights, optimizer);
  }
  void save_model(const std::string& dir, bool write) override;
  GeneratorStates extra_generator_states() override;
  void restore_extra_generator_states(const GeneratorStates& states) override;
  model::NamedTensors unsplit_gradients() override { return optimizer_->unsplit_gradients(); }
  void set_global_step(int64_t global_step) override { forward_backward_->set_global_step(global_step); }
  double validation_loss(data::BatchLoader& loader) override;
  std::vector<std::string> generate(const data::Tokenizer& tokenizer,
                                    const std::vector<data::TranslationExample>& examples, int64_t model_max_length,
                                    bool show_progress) override;
  const StepOptimizer& optimizer() const { return *optimizer_; }
  StepOptimizer& optimizer() { return *optimizer_; }
  ForwardBackward& forward_backward() { return *forward_backward_; }
  const TrainStepSettings& settings() const { return settings_; }

 private:
  model::GPT2LMHeadModel model_;
  std::unique_ptr<ForwardBackward> forward_backward_;
  std::unique_ptr<StepOptimizer> optimizer_;
  data_parallel::GradientSynchronizer* synchronizer_;
  TrainStepSettings settings_;
  bool loss_before_update_ = false;  // set_before_update's hook is set
};


}  // namespace harness::train
