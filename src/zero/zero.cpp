// ZeRO's rules and its one entry (see zero.h).
#include "harness/zero/zero.h"

#include <algorithm>
#include <stdexcept>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/train/plan/plan.h"
#include "harness/train/step/pipeline_forward_backward.h"
#include "harness/zero/moments.h"
#include "harness/zero/sharded_units.h"
#include "harness/zero/zero3_step.h"

namespace harness::zero {
namespace {

namespace dp = harness::data_parallel;

std::string stage_flag(int stage) { return "--zero_stage " + std::to_string(stage); }

// ZeRO-1 and 2: the gradient buckets are reduce-scattered over the ranks holding the same slice
// (of the whole model, of a tensor-parallel shard or of a pipeline stage), and each rank's AdamW
// steps its chunks. ZeRO-2 keeps only its chunks of the gradients too (the full ones let go as
// they are reduce-scattered, a step's batches accumulated into the chunks).
std::unique_ptr<dp::BucketedAllReduce> buckets_of(const train::Plan& plan, const dp::DistContext& gradient) {
  return std::make_unique<dp::BucketedAllReduce>(
      gradient, plan.gradient_sync.bucket_cap_mb, plan.gradient_sync.allreduce,
      plan.zero.stage == 2 ? dp::GradientReduction::kShardedGradients : dp::GradientReduction::kReduceScatter);
}

}  // namespace

void check_zero_choice(const train::ZeroChoice& zero) {
  if (zero.stage < 0 || zero.stage > 3) throw std::invalid_argument(stage_flag(zero.stage) + ": expected 0, 1, 2 or 3");
  if (zero.prefetch < 0) throw std::invalid_argument("--zero_prefetch " + std::to_string(zero.prefetch) + " must be >= 0");
}

void check_zero_rules(const train::Plan& plan) {
  check_zero_choice(plan.zero);
  const int stage = plan.zero.stage;
  if (stage == 0) return;
  if (plan.gradient_sync.kind != dp::GradientSyncKind::kBucketed) {
    throw std::invalid_argument(stage_flag(stage) + " reduce-scatters gradient buckets: it needs --grad_sync bucketed, not " +
                                dp::to_string(plan.gradient_sync.kind));
  }
  if (plan.gradient_sync.allreduce != dp::AllReduceAlgorithm::kBuiltin) {
    throw std::invalid_argument(stage_flag(stage) +
                                " reduce-scatters with the process group's collectives: it cannot take --allreduce ring");
  }
  if (!plan.elastic) return;
  throw std::invalid_argument("--elastic with " + stage_flag(stage) + ": a lost rank's shard of the optimizer state" +
                              (stage >= 2 ? std::string(" and of the gradients") : std::string()) +
                              (stage == 3 ? std::string(" and parameters") : std::string()) +
                              " exists nowhere else, so its replica could not be dropped; use --zero_stage 0");
}

train::StepParts whole_model_zero(model::GPT2LMHeadModel model, const train::Plan& plan, const dp::DistContext& gradient,
                                  const train::OptimizerSettings& optimizer) {
  if (plan.zero.stage == 3) {  // the units gathered around their forward and backward (zero3_step.h)
    return make_zero3(model, gradient, optimizer, plan.zero.prefetch);
  }
  std::unique_ptr<dp::BucketedAllReduce> buckets = buckets_of(plan, gradient);
  train::StepParts parts;
  parts.forward_backward = train::whole_model(model);
  parts.optimizer = train::whole_model_adamw(model, optimizer, sharded_state(optimizer, *buckets));
  parts.sync = std::move(buckets);
  return parts;
}

train::StepParts stage_zero(model::GPT2LMHeadModel model, const train::Plan& plan, const dp::DistContext& gradient,
                            bool embedding, std::unique_ptr<train::ForwardBackward> forward_backward,
                            train::PipelineForwardBackward& stages, const train::OptimizerSettings& optimizer,
                            train::PipelineStageParameters held) {
  train::StepParts parts;
  if (plan.zero.stage == 3) {  // the units of what the stages hold, sharded over the stage's replicas
    auto units = std::make_unique<ShardedUnits>(gradient, stage_units(model, held.held));
    if (const std::optional<size_t> wte = tied_wte_unit(*units); wte && embedding) {
      stages.set_tied_gradient([zero = units.get(), u = *wte] { return zero->gradient_chunk(u); });
    }
    parts.forward_backward = gathered_stages(std::move(forward_backward), *units);
    parts.optimizer = train::stage_adamw(model, optimizer, std::move(held), unit_state(optimizer, *units));
    parts.sync = std::move(units);
    return parts;
  }
  std::unique_ptr<dp::BucketedAllReduce> buckets = buckets_of(plan, gradient);
  if (embedding) {
    const at::Tensor wte = model->transformer->wte->weight;
    buckets->keep_apart(wte);  // before the optimizer attaches the buckets
    stages.set_tied_gradient([zero = buckets.get(), wte] { return zero->gradient_shard_of(wte); });
  }
  parts.forward_backward = std::move(forward_backward);
  parts.optimizer = train::stage_adamw(model, optimizer, std::move(held), sharded_state(optimizer, *buckets));
  parts.sync = std::move(buckets);
  return parts;
}

std::string zero_state_line(const train::Plan& plan, model::GPT2LMHeadModel& model,
                            const train::StepOptimizer& optimizer) {
  int64_t replicated = 0;
  for (const auto& p : model->parameters()) replicated += 2 * p.numel() * static_cast<int64_t>(p.element_size());
  const int stage = plan.zero.stage, shards = plan.gradient_group_size();
  return "run_data_parallel: " + stage_flag(stage) + " keeps " + std::to_string(optimizer.state_bytes()) +
         " bytes of AdamW state on rank 0 (replicated: " + std::to_string(replicated) + " on every rank)" +
         (stage == 2   ? ", and 1/" + std::to_string(shards) + " of the gradients"
          : stage == 3 ? ", and 1/" + std::to_string(shards) + " of the gradients and of the parameters"
                       : std::string());
}

std::string zero3_peak_line(const train::Plan& plan, const dp::GradientSynchronizer* sync) {
  const auto* units = dynamic_cast<const ShardedUnits*>(sync);
  if (units == nullptr) return {};
  int64_t largest = 0;
  for (size_t u = 0; u < units->size(); ++u) largest = std::max(largest, units->full_bytes(u));
  return "run_data_parallel: --zero_stage 3 held at most " + std::to_string(units->peak_bytes()) +
         " bytes of gathered parameters at once while training on rank 0 (largest unit " + std::to_string(largest) +
         " bytes, --zero_prefetch " + std::to_string(plan.zero.prefetch) + ")";
}

}  // namespace harness::zero
