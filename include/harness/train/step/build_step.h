// The one place a training step is built, for every layout and both programs (and each
// generation of an elastic run): plan + groups + model source -> a ready TrainStep. The parts are
// applied in one visible order (build_step in build_step.cpp):
//
//   1. tensor parallelism   the model built split over its tensor-parallel group (each rank reads
//                           its own slices), or an elastic generation's model reconnected to it
//   2. sequence parallelism between its split layers the model holds 1/T of each sequence
//   3. context parallelism  ring attention over the context group, each rank its zigzag chunks
//   4. pipeline stages      this rank's stages (P > 1), or run_pipeline's over its devices, with
//                           --balance auto timed on the model and agreed over the world
//   5. data parallelism     replicated gradients averaged over the D x C ranks holding the same
//                           slice, or ZeRO's parts (zero/zero.h)
//
// and under --elastic the step that drops a lost replica and composes the next generation through
// this same function. Each part is chosen once, here, from the validated plan (plan/plan.h); the
// programs never reach inside. run_pipeline's process has no process group: one rank, empty
// ProcessGroups, and its stages (over its devices' threads) where it gives stage options.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/process_group.h"
#include "harness/device.h"
#include "harness/model/gpt2.h"
#include "harness/parallel/process_groups.h"
#include "harness/train/plan/plan.h"
#include "harness/train/step/forward_backward.h"
#include "harness/train/step/pipeline_forward_backward.h"
#include "harness/train/step/step_optimizer.h"
#include "harness/train/step/train_step.h"

namespace harness::model {
class TensorParallelGroup;
}

namespace harness::train {

class ElasticTrainStep;
class ReplicaBatchMirror;
struct ElasticSettings;

// A rank's place in the run, built once and passed whole.
struct RankContext {
  Plan plan;                       // validated; its world is the run's (an elastic generation's)
  int rank = 0;                    // in that world
  parallel::ProcessGroups groups;  // empty: one process without a process group (run_pipeline), or
                                   // a replacement that has not joined yet
  Device device = Device::cpu(0);  // where its model and batches are (run_pipeline: its first device)
  // The process's launch environment, for elastic training's generations: how it connects, and
  // the world it was started in (the store alone for a replacement).
  data_parallel::DistOptions options;
  data_parallel::DistContext world;

  parallel::Layout layout() const { return plan.layout(); }
  parallel::Coordinates coordinates() const { return layout().coordinates_of(rank); }
};

struct StepComposition {
  OptimizerSettings optimizer;
  // P > 1: this rank's stages (the schedule, its micro-batches, the balance, this rank's device);
  // one process without a process group: its stages over its devices (run_pipeline).
  std::optional<PipelineStepOptions> stages;
  bool debug_sync = false;  // the pipeline's exchanges recorded in its group's store
  // --balance auto: the rows and tokens of the micro-batches GPT-2's pieces are timed on.
  int64_t balance_rows = 1;
  int64_t balance_tokens = 128;
};

// Where the model comes from: given its tensor-parallel split (null when T = 1), the rank's model
// on its device, with the weights every rank holding the same slice starts from.
using MakeModel = std::function<model::GPT2LMHeadModel(std::shared_ptr<model::TensorParallelGroup> split)>;

// Under --elastic: what the step needs to recover from a lost replica (elastic/elastic_step.h).
struct ElasticStepSource {
  ReplicaBatchMirror* mirror = nullptr;  // the dropped replicas' batches
  const ElasticSettings* settings = nullptr;
};

// A built step: `plain` trains (`sync`, its synchronizer, lives here; `stages` points into it
// where it has pipeline stages), or under --elastic `elastic`, which builds its own for each
// generation. `model` is what it trains.
struct BuiltStep {
  BuiltStep();
  BuiltStep(BuiltStep&&) noexcept;
  BuiltStep& operator=(BuiltStep&&) noexcept;
  ~BuiltStep();

  model::GPT2LMHeadModel model{nullptr};
  std::unique_ptr<GPT2TrainStep> plain;
  std::unique_ptr<ElasticTrainStep> elastic;
  std::unique_ptr<data_parallel::GradientSynchronizer> sync;
  PipelineForwardBackward* stages = nullptr;
  std::vector<int> balance_halves;  // the stages' balance in half blocks (--balance auto: as timed and agreed)

  TrainStep& step();
};

// Builds `rank`'s step in the order above. Throws std::invalid_argument when `composition`
// disagrees with the plan (stage options without stages in a process group, P > 1 without them)
// or for ZeRO without a process group. Under `elastic` the step is elastic_step.h's, whose every
// generation is built here again.
BuiltStep build_step(const RankContext& rank, const MakeModel& make_model, const StepComposition& composition,
                     const TrainStepSettings& settings, const std::optional<ElasticStepSource>& elastic = {});

// The step's three parts. `sync` is null where there is nothing to average (one replica of a
// stage); `stages` points into forward_backward for P > 1.
struct StepParts {
  std::unique_ptr<ForwardBackward> forward_backward;
  std::unique_ptr<data_parallel::GradientSynchronizer> sync;
  std::unique_ptr<StepOptimizer> optimizer;
  PipelineForwardBackward* stages = nullptr;
};

// Parts 2 to 5 for a model already built (build_step's, and PipelineTrainStep's for tests of a
// pipeline on one process); the same refusals.
StepParts compose_step(model::GPT2LMHeadModel model, const Plan& plan, const parallel::ProcessGroups& groups,
                       const StepComposition& settings);

}  // namespace harness::train
