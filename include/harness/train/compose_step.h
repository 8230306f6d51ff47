// Where a training step is composed, for every layout and both programs: the model (already split
// over its tensor-parallel group) is switched to sequence parallelism where asked, given its
// context-parallel group where C > 1, cut into this rank's pipeline stages where P > 1, then the
// data-parallel choice is made (replicated gradients, ZeRO-1/2's buckets or ZeRO-3's units) over
// the ranks that hold the same slice of it (D x C). Each part is chosen once, here, from the
// validated layout and typed settings; the programs never reach inside. run_pipeline's process
// has no process group: one rank, empty ProcessGroups, and its stages (over its devices' threads)
// where it gives stage options.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "harness/data_parallel/grad_sync.h"
#include "harness/model/gpt2.h"
#include "harness/parallel/layout.h"
#include "harness/parallel/process_groups.h"
#include "harness/train/forward_backward.h"
#include "harness/train/pipeline_forward_backward.h"
#include "harness/train/step_optimizer.h"

namespace harness::train {

// How the ranks holding the same slice of the model keep its gradients and optimizer state.
struct DataParallelSettings {
  int zero_stage = 0;     // 0: replicated; 1: AdamW state sharded; 2: and the gradients; 3: and the parameters
  int zero_prefetch = 1;  // ZeRO-3: units all-gathered ahead
  data_parallel::GradientSyncKind gradient_sync = data_parallel::GradientSyncKind::kBucketed;
  double bucket_cap_mb = 25.0;
  data_parallel::AllReduceAlgorithm allreduce = data_parallel::AllReduceAlgorithm::kBuiltin;
  at::ScalarType reduce_dtype = at::kFloat;  // of the gradients' all-reduce (kFloat or kBFloat16)
};

struct StepComposition {
  OptimizerSettings optimizer;
  DataParallelSettings data_parallel;
  // P > 1: this rank's stages (the schedule, its micro-batches, the balance, this rank's device);
  // one process without a process group: its stages over its devices (run_pipeline).
  std::optional<PipelineStepOptions> stages;
  bool debug_sync = false;  // the pipeline's exchanges recorded in its group's store
};

// The step's three parts. `sync` is null where there is nothing to average (one replica of a
// stage); `stages` points into forward_backward for P > 1.
struct StepParts {
  std::unique_ptr<ForwardBackward> forward_backward;
  std::unique_ptr<data_parallel::GradientSynchronizer> sync;
  std::unique_ptr<StepOptimizer> optimizer;
  PipelineForwardBackward* stages = nullptr;
};

// Throws std::invalid_argument when `settings` disagree with `layout` (stages without P > 1 in a
// process group, or P > 1 without them), or for ZeRO without a process group.
StepParts compose_step(model::GPT2LMHeadModel model, const parallel::Layout& layout,
                       const parallel::ProcessGroups& groups, const StepComposition& settings);

}  // namespace harness::train
