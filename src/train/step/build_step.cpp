// The composition point of a training step (see build_step.h).
#include "harness/train/step/build_step.h"

#include <algorithm>
#include <stdexcept>

#include <torch/torch.h>

#include "harness/context_parallel/group.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/tensor_parallel/group.h"
#include "harness/train/elastic/elastic_step.h"
#include "harness/train/step/context_parallel_step.h"
#include "harness/zero/zero.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;

// P > 1: this rank's stages, the others' activations and gradients coming by send/recv, and an
// AdamW on what the stages hold, averaged over the stage's replicas (or sharded over them by ZeRO,
// zero/zero.h). A stage holding the tied wte gives it a bucket (a unit) of its own, so that the
// first and the last stage's chunks of it are the same elements, summed over the embedding group.
StepParts cut_pipeline(model::GPT2LMHeadModel model, const Plan& plan, const parallel::ProcessGroups& groups,
                       const StepComposition& settings) {
  StepParts parts;
  auto stages = std::make_unique<PipelineForwardBackward>(
      model, *settings.stages, PipelineProcesses{groups.pipeline, groups.embedding, settings.debug_sync});
  parts.stages = stages.get();
  parts.forward_backward = std::move(stages);

  PipelineStageParameters held;
  held.held = parts.stages->held_parameters();
  held.pipeline = groups.pipeline;
  // Under a zero-bubble schedule, every stage steps before the global norm arrives but the first
  // stage's rank: its last backward ends the step everywhere, so the norm reaches it at once.
  held.post_validate = settings.optimizer.post_validate && pipeline::splits_backward(settings.stages->schedule) &&
                       parts.stages->device_of_stage(0) != groups.pipeline.rank;
  std::vector<at::Tensor> parameters;
  for (const auto& item : model->named_parameters()) {
    held.owner[item.key()] = parts.stages->owner_of(item.key());
    if (std::find(held.held.begin(), held.held.end(), item.key()) != held.held.end()) parameters.push_back(item.value());
  }
  if (plan.zero.stage > 0) {
    StepParts sharded = zero::stage_zero(model, plan, groups.gradient, groups.embedding.has_value(),
                                         std::move(parts.forward_backward), *parts.stages, settings.optimizer,
                                         std::move(held));
    sharded.stages = parts.stages;
    return sharded;
  }
  if (plan.gradient_group_size() > 1) {  // a stage of the only replica has nothing to average with
    const GradientSyncChoice& g = plan.gradient_sync;
    parts.sync = dp::make_gradient_synchronizer(g.kind, groups.gradient, g.bucket_cap_mb, g.allreduce);
    parts.sync->attach(parameters);
  }
  parts.optimizer = stage_adamw(model, settings.optimizer, std::move(held));
  return parts;
}

// One process driving the stages over its devices' worker threads (run_pipeline, model parallel
// or pipelined): no process group, nothing to average, the replica's AdamW.
StepParts in_process_stages(model::GPT2LMHeadModel model, const StepComposition& settings) {
  StepParts parts;
  auto stages = std::make_unique<PipelineForwardBackward>(model, *settings.stages);
  parts.stages = stages.get();
  parts.forward_backward = std::move(stages);
  parts.optimizer = replicated_adamw(model, settings.optimizer);
  return parts;
}

// P = 1: the whole model (or this rank's tensor-parallel slices of it) on this rank, its gradients
// averaged over the replicas: replicated AdamW, or ZeRO's parts (zero/zero.h).
StepParts whole_model_step(model::GPT2LMHeadModel model, const Plan& plan, const parallel::ProcessGroups& groups,
                           const StepComposition& settings) {
  if (plan.zero.stage > 0) return zero::whole_model_zero(model, plan, groups.gradient, settings.optimizer);
  StepParts parts;
  parts.forward_backward = whole_model(model);
  parts.optimizer = replicated_adamw(model, settings.optimizer);
  if (!groups.gradient.group) return parts;  // one process and no process group (run_pipeline on one device)
  const GradientSyncChoice& g = plan.gradient_sync;
  parts.sync = dp::make_gradient_synchronizer(g.kind, groups.gradient, g.bucket_cap_mb, g.allreduce);
  parts.sync->attach(*model);
  return parts;
}

}  // namespace

StepParts compose_step(model::GPT2LMHeadModel model, const Plan& plan, const parallel::ProcessGroups& groups,
                       const StepComposition& settings) {
  const parallel::Layout layout = plan.layout();
  const bool pipelined = layout.pipeline_parallel_size() > 1;
  const int C = layout.context_parallel_size();
  // One process without a process group: run_pipeline's, whose stages (if any) are its devices.
  const bool alone = layout.world_size() == 1 && !groups.gradient.group;
  if (pipelined && !settings.stages) {
    throw std::invalid_argument("compose_step: a layout of pipeline stages needs their options");
  }
  if (!pipelined && settings.stages && !alone) {
    throw std::invalid_argument("compose_step: stage options given to a layout without pipeline stages");
  }
  if (alone && plan.zero.stage != 0) {
    throw std::invalid_argument("compose_step: ZeRO shards over a process group, and this process has none");
  }
  // 2. Sequence parallelism: between its split layers the model holds 1/T of each sequence.
  const int sequence_split = layout.sequence_parallel() ? layout.tensor_parallel_size() : 1;
  if (sequence_split > 1) model->set_sequence_parallel(true);
  // 3. Context parallelism: every rank of a context group holds the whole replica (its
  // tensor-parallel slices, or its pipeline stages) and runs its zigzag shard of each sequence,
  // attention passing keys and values round the group (each stage's ring its own).
  if (C > 1) model->set_context_parallel(context_parallel::make_context_parallel_group(groups.context));
  // 4. Pipeline stages, then 5. the data-parallel choice over the ranks holding the same slice.
  StepParts parts = pipelined         ? cut_pipeline(model, plan, groups, settings)
                    : settings.stages ? in_process_stages(model, settings)
                                      : whole_model_step(model, plan, groups, settings);
  if (C > 1 || sequence_split > 1) {  // the batch's sequences padded to what the splits divide, and sharded
    parts.forward_backward =
        context_parallel(std::move(parts.forward_backward), C, groups.context.rank, sequence_split);
  }
  if (parts.sync && plan.gradient_sync.reduce_dtype != at::kFloat) {
    parts.sync->set_reduce_dtype(plan.gradient_sync.reduce_dtype);
  }
  return parts;
}

namespace {

// Part 1: the split a rank's model is built with (each rank builds and loads its own slices); a
// replacement joining an elastic run has no group yet, and is connected when it joins.
std::shared_ptr<model::TensorParallelGroup> tensor_split(const RankContext& rank) {
  const int T = rank.plan.tensor_parallel_size;
  if (T == 1) return nullptr;
  if (!rank.groups.tensor.group) {
    return tensor_parallel::make_unconnected_tensor_parallel_group(rank.coordinates().tensor, T);
  }
  return tensor_parallel::make_tensor_parallel_group(rank.groups.tensor);
}

// --balance auto: GPT-2's pieces timed on this rank's model and device, cut for the stages; with a
// process group, rank 0's cut is everyone's.
std::vector<int> timed_balance(const RankContext& rank, model::GPT2LMHeadModel& model,
                               const StepComposition& composition) {
  const PipelineStepOptions& stages = *composition.stages;
  const int devices = rank.plan.pipeline_parallel_size > 1 ? rank.plan.pipeline_parallel_size
                                                           : static_cast<int>(stages.devices.size());
  std::vector<int> halves = pipeline::balance_gpt2_by_time(model, rank.device, devices * stages.virtual_stages,
                                                           composition.balance_rows, composition.balance_tokens);
  const dp::DistContext& world = rank.groups.world;
  if (!world.group || world.world_size == 1) return halves;
  at::Tensor agreed = torch::tensor(std::vector<int64_t>(halves.begin(), halves.end()), torch::kLong)
                          .to(rank.device.torch_device());
  std::vector<at::Tensor> tensors{agreed};
  world.group->broadcast(tensors)->wait();
  agreed = agreed.to(torch::kCPU);
  return std::vector<int>(agreed.data_ptr<int64_t>(), agreed.data_ptr<int64_t>() + agreed.numel());
}

}  // namespace

BuiltStep::BuiltStep() = default;
BuiltStep::BuiltStep(BuiltStep&&) noexcept = default;
BuiltStep& BuiltStep::operator=(BuiltStep&&) noexcept = default;
BuiltStep::~BuiltStep() = default;

TrainStep& BuiltStep::step() { return elastic ? static_cast<TrainStep&>(*elastic) : *plain; }

BuiltStep build_step(const RankContext& rank, const MakeModel& make_model, const StepComposition& composition,
                     const TrainStepSettings& settings, const std::optional<ElasticStepSource>& elastic) {
  BuiltStep built;
  built.model = make_model(tensor_split(rank));  // 1. tensor parallelism
  StepComposition resolved = composition;
  if (resolved.stages && rank.plan.pipeline.balance.automatic && resolved.stages->balance_halves.empty()) {
    resolved.stages->balance_halves = timed_balance(rank, built.model, resolved);
  }
  if (resolved.stages) built.balance_halves = resolved.stages->balance_halves;
  if (elastic) {  // each generation's step is built below, through this function again
    built.elastic = std::make_unique<ElasticTrainStep>(built.model, resolved, rank.options, rank.world, *elastic->mirror,
                                                    *elastic->settings, settings);
    return built;
  }
  StepParts parts = compose_step(built.model, rank.plan, rank.groups, resolved);  // 2. to 5.
  built.sync = std::move(parts.sync);
  built.stages = parts.stages;
  built.plain = std::make_unique<GPT2TrainStep>(built.model, std::move(parts.forward_backward),
                                                std::move(parts.optimizer), built.sync.get(), settings);
  return built;
}

}  // namespace harness::train
