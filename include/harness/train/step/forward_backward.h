// How a training step runs the forward and backward of its batches: one of the three parts a step
// is made of (train_step.h: this, a gradient synchronizer and a StepOptimizer), chosen once by the
// layout. The whole model on this process (whole_model: one device, model parallel, data and
// tensor parallel), or GPT-2 cut into pipeline stages run by a schedule
// (pipeline_forward_backward.h: on this process's worker threads, or over the stages' processes).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/data/collate.h"
#include "harness/data/example.h"
#include "harness/data/loader.h"
#include "harness/data/tokenizer.h"
#include "harness/model/gpt2.h"
#include "harness/model/precision.h"

namespace harness::train {

class ForwardBackward {
 public:
  virtual ~ForwardBackward() = default;

  // The forward and backward of `batch`, micro-step `k` (0, 1, ...) of an optimizer step, under
  // `precision`: SPEC §3's loss of the batch over `weight_sum` (the label weight of all the step's
  // batches together, on loss_device(); undefined: the batch's own, a step of one batch), its
  // gradients accumulated into the parameters. Returns
  // the loss, detached, on loss_device(); undefined on a process that runs no last stage.
  virtual at::Tensor run(const data::Batch& batch, const at::Tensor& weight_sum, int64_t k,
                         model::Precision precision) = 0;
  // After every batch's backward and the data-parallel synchronisation, before the optimizer: what
  // the gradients still need (a pipeline's tied head gradient added to wte's).
  virtual void finish_gradients() {}
  // The step's loss from the sum of run()'s returns here (a pipeline's other stages get the last
  // stage's: a collective over the pipeline group).
  virtual double step_loss(const at::Tensor& local) { return local.item<double>(); }
  // How many times run(batch) accumulates into each gradient it produces: one backward, or one
  // per micro-batch for a schedule (each stage's parameters once per micro-batch backward,
  // activation checkpointing's recomputation adding none). The gradient synchronizer is told, so
  // that it reduces a parameter during the backward passes, once its gradient is complete.
  virtual int64_t gradient_accumulations(const data::Batch& batch) const { return 1; }

  // Where a batch's tensors must be before run(), and where the loss is computed.
  virtual c10::Device input_device() const = 0;
  virtual c10::Device loss_device() const = 0;
  // The optimizer steps taken before the next run() (schedules derive their dropout streams from it).
  virtual void set_global_step(int64_t global_step) {}

  // Evaluation through this part, where the model lives on several processes (TrainStep's
  // validation_loss and generate); nullopt: evaluate the gathered model as one.
  virtual std::optional<double> validation_loss(data::BatchLoader& loader) { return std::nullopt; }
  virtual std::optional<std::vector<std::string>> generate(const data::Tokenizer& tokenizer,
                                                           const std::vector<data::TranslationExample>& examples,
                                                           int64_t model_max_length, bool show_progress) {
    return std::nullopt;
  }
};

// A part that changes what another does around it (context parallelism's shards, a pipeline
// stage's gathered ZeRO-3 units): every call goes to `inner` unless the wrapper says otherwise.
class WrappedForwardBackward : public ForwardBackward {
 public:
  at::Tensor run(const data::Batch& batch, const at::Tensor& weight_sum, int64_t k,
                 model::Precision precision) override {
    return inner_->run(batch, weight_sum, k, precision);
  }
  void finish_gradients() override { inner_->finish_gradients(); }
  double step_loss(const at::Tensor& local) override { return inner_->step_loss(local); }
  int64_t gradient_accumulations(const data::Batch& batch) const override {
    return inner_->gradient_accumulations(batch);
  }
  c10::Device input_device() const override { return inner_->input_device(); }
  c10::Device loss_device() const override { return inner_->loss_device(); }
  void set_global_step(int64_t global_step) override { inner_->set_global_step(global_step); }
  std::optional<double> validation_loss(data::BatchLoader& loader) override { return inner_->validation_loss(loader); }
  std::optional<std::vector<std::string>> generate(const data::Tokenizer& tokenizer,
                                                   const std::vector<data::TranslationExample>& examples,
                                                   int64_t model_max_length, bool show_progress) override {
    return inner_->generate(tokenizer, examples, model_max_length, show_progress);
  }

 protected:
  // Throws std::invalid_argument, naming `what`, when `inner` is null.
  WrappedForwardBackward(std::unique_ptr<ForwardBackward> inner, const std::string& what);
  ForwardBackward& inner() { return *inner_; }

 private:
  std::unique_ptr<ForwardBackward> inner_;
};

// The model's own forward(), then backward from the loss.
std::unique_ptr<ForwardBackward> whole_model(model::GPT2LMHeadModel model);

}  // namespace harness::train
