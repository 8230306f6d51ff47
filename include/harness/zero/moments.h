// ZeRO's parts of a layout's AdamW (train/step/held_adamw.h): the state of the parameters this rank
// steps kept as its chunks over the data-parallel group, by ZeRO-1/2 (the moments of the gradient
// buckets' chunks) or by ZeRO-3 (the units' chunks of the weights, gradients and moments).
#pragma once

#include <memory>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/train/step/held_adamw.h"
#include "harness/train/step/step_optimizer.h"
#include "harness/zero/sharded_units.h"

namespace harness::zero {

// ZeRO-1 and 2: `buckets` (kReduceScatter or kShardedGradients over the data-parallel group, the
// step's synchronizer) is attached to `held` here; each rank keeps AdamW's moments of its chunks
// (sharded_adamw.h).
std::unique_ptr<train::HeldAdamW> sharded_moments(train::NamedParameters held, const train::OptimizerSettings& settings,
                                                  data_parallel::BucketedAllReduce& buckets);

// ZeRO-3: every held parameter is in one of `units` (built over them, the step's synchronizer);
// AdamW steps the chunks with FusedAdamW's kernel.
std::unique_ptr<train::HeldAdamW> unit_moments(const train::NamedParameters& held,
                                               const train::OptimizerSettings& settings, ShardedUnits& units);

// The same as the optimizers' state factories (step_optimizer.h's HeldAdamWFactory), for
// whole_model_adamw and stage_adamw.
train::HeldAdamWFactory sharded_state(const train::OptimizerSettings& settings, data_parallel::BucketedAllReduce& buckets);
train::HeldAdamWFactory unit_state(const train::OptimizerSettings& settings, ShardedUnits& units);

}  // namespace harness::zero
