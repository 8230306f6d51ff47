// run_pipeline's training step as one object: a GPT2TrainStep made of the parts compose_step gives
// one process without a process group and with stage options (a PipelineForwardBackward over this
// process's devices, replicated AdamW, no gradient synchronizer). It overrides nothing; its
// accessors reach the pipeline part.
#pragma once

#include "harness/train/step/build_step.h"
#include "harness/train/step/pipeline_forward_backward.h"
#include "harness/train/step/train_step.h"

namespace harness::train {

class PipelineTrainStep final : public GPT2TrainStep {
 public:
  // Places the model's blocks by the balance (model->place) and starts the workers. Throws
  // std::invalid_argument, naming the flag, on a bad schedule, balance or device count.
  PipelineTrainStep(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer, PipelineStepOptions options,
                    TrainStepSettings settings = {});

  PipelineForwardBackward& pipeline() { return *pipeline_; }
  const std::vector<int>& balance_halves() const { return pipeline_->balance_halves(); }
  std::string balance_text() const { return pipeline_->balance_text(); }
  int stages() const { return pipeline_->stages(); }
  const pipeline::TrainingSchedule& last_schedule() const { return pipeline_->last_schedule(); }
  const std::vector<int>& last_peak_in_flight() const { return pipeline_->last_peak_in_flight(); }
  const std::vector<int64_t>& last_peak_held_bytes() const { return pipeline_->last_peak_held_bytes(); }
  pipeline::ScheduleExecutor& executor() { return pipeline_->executor(); }

 private:
  PipelineTrainStep(model::GPT2LMHeadModel model, StepParts parts, TrainStepSettings settings);

  PipelineForwardBackward* pipeline_;
};

}  // namespace harness::train
