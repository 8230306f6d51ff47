// run_pipeline's training step, built of its parts (see pipeline_train_step.h).
#include "harness/train/step/pipeline_train_step.h"

#include "harness/parallel/layout.h"
#include "harness/parallel/process_groups.h"

namespace harness::train {
namespace {

// The parts of one process's stages, composed where every layout's are.
StepParts stage_parts(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer, PipelineStepOptions options) {
  StepComposition composition;
  composition.optimizer = optimizer;
  composition.stages = std::move(options);
  return compose_step(std::move(model), Plan{}, parallel::ProcessGroups{}, composition);
}

}  // namespace

PipelineTrainStep::PipelineTrainStep(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer,
                                     PipelineStepOptions options, TrainStepSettings settings)
    : PipelineTrainStep(model, stage_parts(model, optimizer, std::move(options)), std::move(settings)) {}

PipelineTrainStep::PipelineTrainStep(model::GPT2LMHeadModel model, StepParts parts, TrainStepSettings settings)
    : GPT2TrainStep(model, std::move(parts.forward_backward), std::move(parts.optimizer), nullptr, std::move(settings)),
      pipeline_(parts.stages) {}

}  // namespace harness::train
