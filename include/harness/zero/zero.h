// ZeRO (DeepSpeed's Zero Redundancy Optimizer) for every layout, in one place: the rules a plan
// must keep, and the one entry that gives a stage what ZeRO needs of it. The pieces:
//
//     sharded_adamw.h   ZeRO-1/2: AdamW stepping this rank's chunks of the reduce-scattered buckets
//     sharded_units.h   ZeRO-3: the model cut into units, each sharded and gathered for its use
//     zero3_step.h      GPT-2's units, and the forward-backward that gathers them around their use
//     moments.h         the AdamW state kept as either's chunks, for stage optimizers
//
// The collectives are data_parallel/bucketed_all_reduce.h's (reduce-scatter buckets) and
// sharded_units.h's (all-gather and reduce-scatter per unit); which of them a run uses is
// decided here.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/gpt2.h"
#include "harness/train/step/build_step.h"
#include "harness/train/step/forward_backward.h"
#include "harness/train/step/held_adamw.h"
#include "harness/train/step/step_optimizer.h"

namespace harness::train {
struct Plan;
struct ZeroChoice;
class PipelineForwardBackward;
}

namespace harness::zero {

// The stage and prefetch alone (what a memory plan needs to count ZeRO's shards): --zero_stage 0
// to 3, --zero_prefetch >= 0.
void check_zero_choice(const train::ZeroChoice& zero);

// Every ZeRO rule, the flags named: check_zero_choice's, and for a stage above 0 --grad_sync
// bucketed, the process group's collectives (not --allreduce ring), and no --elastic (a lost
// rank's shards exist nowhere else). Called by train::Plan::validate().
void check_zero_rules(const train::Plan& plan);

// What ZeRO gives one rank's step (build_step.h's parts): the gradient synchronizer (the buckets
// that reduce-scatter, or the sharded units), the optimizer over this rank's shards, and under
// ZeRO-3 the forward-backward that gathers the units around their use.
//
// The whole model (or this rank's tensor-parallel slices of it) on this rank, sharded over
// `gradient` (the ranks holding the same slice) by `plan.zero.stage` >= 1.
train::StepParts whole_model_zero(model::GPT2LMHeadModel model, const train::Plan& plan,
                                  const data_parallel::DistContext& gradient, const train::OptimizerSettings& optimizer);

// This rank's pipeline stages (`stages`, holding `held`), their state sharded over `gradient` by
// `plan.zero.stage` >= 1. A stage holding the tied wte (`embedding`: the group of the first and the
// last stage) keeps it apart, so that both stages' shards of it are the same elements. Under
// ZeRO-3 the forward-backward returned wraps `forward_backward`; the caller sets `stages`.
train::StepParts stage_zero(model::GPT2LMHeadModel model, const train::Plan& plan,
                            const data_parallel::DistContext& gradient, bool embedding,
                            std::unique_ptr<train::ForwardBackward> forward_backward,
                            train::PipelineForwardBackward& stages, const train::OptimizerSettings& optimizer,
                            train::PipelineStageParameters held);

// Rank 0's line on what ZeRO keeps there, against what a replicated run keeps on every rank
// ("run_data_parallel: --zero_stage 2 keeps N bytes of AdamW state on rank 0 (replicated: M on
// every rank), and 1/4 of the gradients"), and after training what ZeRO-3 gathered at once.
std::string zero_state_line(const train::Plan& plan, model::GPT2LMHeadModel& model, const train::StepOptimizer& optimizer);
// Empty unless `sync` is ZeRO-3's units.
std::string zero3_peak_line(const train::Plan& plan, const data_parallel::GradientSynchronizer* sync);

}  // namespace harness::zero
