// run_pipeline's training step, built of its parts (see pipeline_train_step.h).
#include "harness/train/pipeline_train_step.h"

namespace harness::train {

PipelineTrainStep::PipelineTrainStep(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer,
                                     PipelineStepOptions options, TrainStepSettings settings)
    : GPT2TrainStep(model, std::make_unique<PipelineForwardBackward>(model, std::move(options)),
                    replicated_adamw(model, optimizer), nullptr, std::move(settings)),
      pipeline_(&static_cast<PipelineForwardBackward&>(forward_backward())) {}

}  // namespace harness::train
