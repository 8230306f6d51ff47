// A run's plan (see plan.h).
#include "harness/train/plan/plan.h"

#include <stdexcept>

#include "harness/pipeline/balance.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/zero/zero.h"

namespace harness::train {
int Plan::data_parallel_size() const {
  const int model_ranks = context_parallel_size * tensor_parallel_size * pipeline_parallel_size;
  return model_ranks > 0 && world_size % model_ranks == 0 ? world_size / model_ranks : 0;
}

parallel::Layout Plan::layout() const { return parallel::Layout::create(world_size, layout_sizes()); }

parallel::LayoutSizes Plan::layout_sizes() const {
  parallel::LayoutSizes sizes;
  sizes.tensor = tensor_parallel_size;
  sizes.context = context_parallel_size;
  sizes.pipeline = pipeline_parallel_size;
  sizes.sequence_parallel = sequence_parallel;
  sizes.loss_on_first_stage = pipeline::placement_of(pipeline.schedule) == pipeline::StagePlacement::kV;
  return sizes;
}

void Plan::validate() const {
  const int D = layout().data_parallel_size();
  zero::check_zero_rules(*this);
  if (!elastic) return;
  if (D < 2) {
    throw std::invalid_argument("--elastic keeps training when a data-parallel replica is lost: it needs at least "
                                "2 replicas, and --world_size " + std::to_string(world_size) + " makes " +
                                std::to_string(D) + " (with one, use --max_restarts)");
  }
  if (min_replicas < 1 || min_replicas > D) {
    throw std::invalid_argument("--min_replicas " + std::to_string(min_replicas) + ": expected 1 to " +
                                std::to_string(D) + " (the data-parallel replicas)");
  }
}

nlohmann::json plan_to_json(const Plan& plan) {
  const PipelineScheduleConfig& pipe = plan.pipeline;
  return {
      {"world_size", plan.world_size},
      {"data_parallel_size", plan.data_parallel_size()},
      {"context_parallel_size", plan.context_parallel_size},
      {"tensor_parallel_size", plan.tensor_parallel_size},
      {"pipeline_parallel_size", plan.pipeline_parallel_size},
      {"sequence_parallel", plan.sequence_parallel},
      {"zero_stage", plan.zero.stage},
      {"zero_prefetch", plan.zero.prefetch},
      {"pipeline_schedule", pipeline::to_string(pipe.schedule)},
      {"n_chunk", pipe.n_chunk},
      {"virtual_stages", pipe.virtual_stages},
      {"balance", pipe.balance.automatic ? "auto" : pipeline::format_halves(pipe.balance.halves_per_stage)},
      {"activation_checkpointing", pipeline::to_string(pipe.activation_checkpointing)},
      {"grad_sync", data_parallel::to_string(plan.gradient_sync.kind)},
      {"bucket_cap_mb", plan.gradient_sync.bucket_cap_mb},
      {"allreduce", data_parallel::to_string(plan.gradient_sync.allreduce)},
      {"grad_reduce_dtype", plan.gradient_sync.reduce_dtype == at::kBFloat16 ? "bf16" : "fp32"},
      {"elastic", plan.elastic},
      {"min_replicas", plan.min_replicas},
  };
}

}  // namespace harness::train
