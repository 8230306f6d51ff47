// The composition point of a training step (see compose_step.h).
#include "harness/train/compose_step.h"

#include <algorithm>
#include <stdexcept>

#include "harness/context_parallel/group.h"
#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/train/zero/sharded_units.h"
#include "harness/train/context_parallel_step.h"
#include "harness/train/zero/zero3_step.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;

// --zero_stage 1 and 2: the gradient buckets are reduce-scattered over the ranks holding the same
// slice (of the whole model, of a tensor-parallel shard or of a pipeline stage), and each rank's
// AdamW steps its chunks. ZeRO-2 keeps only its chunks of the gradients too (the full ones let go
// as they are reduce-scattered, a step's batches accumulated into the chunks).
std::unique_ptr<dp::BucketedAllReduce> zero_buckets(const DataParallelSettings& s, const dp::DistContext& gradient) {
  if (s.zero_stage != 1 && s.zero_stage != 2) return nullptr;
  return std::make_unique<dp::BucketedAllReduce>(
      gradient, s.bucket_cap_mb, s.allreduce,
      s.zero_stage == 2 ? dp::GradientReduction::kShardedGradients : dp::GradientReduction::kReduceScatter);
}

// P > 1: this rank's stages, the others' activations and gradients coming by send/recv, and an
// AdamW on what the stages hold, averaged over the stage's replicas (sharded over them by ZeRO-1/2,
// or the stage's units by ZeRO-3, gathered for each step). A stage holding the tied wte gives it a
// bucket (a unit) of its own, so that the first and the last stage's chunks of it are the same
// elements, summed over the embedding group.
StepParts cut_pipeline(model::GPT2LMHeadModel model, const parallel::Layout& layout,
                       const parallel::ProcessGroups& groups, const StepComposition& settings) {
  const DataParallelSettings& s = settings.data_parallel;
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
  if (std::unique_ptr<dp::BucketedAllReduce> buckets = zero_buckets(s, groups.gradient)) {
    if (groups.embedding) {
      const at::Tensor wte = model->transformer->wte->weight;
      buckets->keep_apart(wte);  // before stage_adamw attaches the buckets
      parts.stages->set_tied_gradient([zero = buckets.get(), wte] { return zero->gradient_shard_of(wte); });
    }
    parts.optimizer = stage_adamw(model, settings.optimizer, std::move(held), buckets.get());
    parts.sync = std::move(buckets);
    return parts;
  }
  if (s.zero_stage == 3) {  // the units of what the stages hold, sharded over the stage's replicas
    auto units = std::make_unique<zero::ShardedUnits>(groups.gradient, zero::stage_units(model, held.held));
    if (const std::optional<size_t> wte = zero::tied_wte_unit(*units); wte && groups.embedding) {
      parts.stages->set_tied_gradient([zero = units.get(), u = *wte] { return zero->gradient_chunk(u); });
    }
    parts.forward_backward = zero::gathered_stages(std::move(parts.forward_backward), *units);
    parts.optimizer = stage_adamw(model, settings.optimizer, std::move(held), *units);
    parts.sync = std::move(units);
    return parts;
  }
  if (layout.gradient_group_size() > 1) {  // a stage of the only replica has nothing to average with
    parts.sync = dp::make_gradient_synchronizer(s.gradient_sync, groups.gradient, s.bucket_cap_mb, s.allreduce);
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
// averaged over the replicas: replicated AdamW, ZeRO-1/2's over the buckets its reduce-scattering
// synchronizer hands it, or ZeRO-3's units gathered around their forward and backward
// (train/zero/zero3_step.h), which are the step's synchronizer.
StepParts whole_model_step(model::GPT2LMHeadModel model, const parallel::ProcessGroups& groups,
                           const StepComposition& settings) {
  const DataParallelSettings& s = settings.data_parallel;
  StepParts parts;
  if (s.zero_stage == 3) {
    zero::Zero3Parts zero3 = zero::make_zero3(model, groups.gradient, settings.optimizer, s.zero_prefetch);
    parts.forward_backward = std::move(zero3.forward_backward);
    parts.optimizer = std::move(zero3.optimizer);
    parts.sync = std::move(zero3.units);
    return parts;
  }
  parts.forward_backward = whole_model(model);
  if (!groups.gradient.group) {  // one process and no process group (run_pipeline on one device)
    parts.optimizer = replicated_adamw(model, settings.optimizer);
    return parts;
  }
  if (std::unique_ptr<dp::BucketedAllReduce> buckets = zero_buckets(s, groups.gradient)) {
    parts.optimizer = sharded_adamw(model, settings.optimizer, *buckets);
    parts.sync = std::move(buckets);
    return parts;
  }
  parts.sync = dp::make_gradient_synchronizer(s.gradient_sync, groups.gradient, s.bucket_cap_mb, s.allreduce);
  parts.sync->attach(*model);
  parts.optimizer = replicated_adamw(model, settings.optimizer);
  return parts;
}

}  // namespace

StepParts compose_step(model::GPT2LMHeadModel model, const parallel::Layout& layout,
                       const parallel::ProcessGroups& groups, const StepComposition& settings) {
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
  if (alone && settings.data_parallel.zero_stage != 0) {
    throw std::invalid_argument("compose_step: ZeRO shards over a process group, and this process has none");
  }
  // Sequence parallelism: between its split layers the model holds 1/T of each sequence.
  const int sequence_split = layout.sequence_parallel() ? layout.tensor_parallel_size() : 1;
  if (sequence_split > 1) model->set_sequence_parallel(true);
  // Context parallelism: every rank of a context group holds the whole replica (its
  // tensor-parallel slices, or its pipeline stages) and runs its zigzag shard of each sequence,
  // attention passing keys and values round the group (each stage's ring its own).
  if (C > 1) model->set_context_parallel(context_parallel::make_context_parallel_group(groups.context));
  StepParts parts = pipelined           ? cut_pipeline(model, layout, groups, settings)
                    : settings.stages ? in_process_stages(model, settings)
                                      : whole_model_step(model, groups, settings);
  if (C > 1 || sequence_split > 1) {  // the batch's sequences padded to what the splits divide, and sharded
    parts.forward_backward =
        context_parallel(std::move(parts.forward_backward), C, groups.context.rank, sequence_split);
  }
  if (parts.sync && settings.data_parallel.reduce_dtype != at::kFloat) {
    parts.sync->set_reduce_dtype(settings.data_parallel.reduce_dtype);
  }
  return parts;
}

}  // namespace harness::train
