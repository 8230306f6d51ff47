// run_pipeline's work as a library call: a plain config in (the program fills it from its flags),
// SPEC §7's lines and files out. It trains on one device, in model parallel or through a pipeline
// over its devices' worker threads.
#pragma once

#include <string>

#include "harness/train/plan/plan.h"
#include "harness/train/run_config.h"
#include "harness/train/step/pipeline_forward_backward.h"

namespace harness::train {

// --model_parallel_mode: none (one device), model_parallel (the stages one batch at a time) or
// pipeline_parallel (micro-batches through the stages' schedule).
enum class ModelParallelMode { kSingleDevice, kModelParallel, kPipelineParallel };

// "" / "model_parallel" / "pipeline_parallel"; anything else throws std::invalid_argument naming
// --model_parallel_mode.
ModelParallelMode parse_model_parallel_mode(const std::string& text);
// "single_device" / "model_parallel" / "pipeline_parallel", as the start line prints it.
std::string to_string(ModelParallelMode mode);

struct PipelineConfig {
  RunConfig run;
  ModelParallelMode mode = ModelParallelMode::kSingleDevice;
  bool shuffle = false;  // the original trains in order (shuffle=False)
  // One process: its plan is the pipeline's schedule (--n_chunk, --pipeline_schedule, ...; in
  // pipeline_parallel mode) over its devices.
  Plan plan;
};
int run_pipeline(const PipelineConfig& config);

// --memory_plan: the plan of the run the flags describe (plan/memory_plan.h), printed on stdout.
// Returns the exit status, 0.
int print_memory_plan(const PipelineConfig& config);

}  // namespace harness::train
