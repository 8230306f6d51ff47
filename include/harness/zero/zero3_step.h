// --zero_stage 3's parts of a training step (train_step.h), over one ShardedUnits (sharded_units.h):
// GPT-2 cut into units (each transformer block, and the embeddings with ln_f and the tied head),
// each data-parallel rank holding 1/N of every unit.
//   - the forward-backward gathers each unit right before its forward and lets it go after, and
//     gathers it again right before its backward (a hook on the unit's output), `prefetch` units
//     of the step's order (embeddings, blocks, the head; then the blocks backwards) ahead;
//   - the synchronizer is the ShardedUnits itself: a unit's gradients are reduce-scattered into
//     the chunks as soon as they are complete (unit 0's at the end, when the embedding's backward
//     has added to the head's gradient of the tied wte);
//   - the optimizer is unit_adamw (step_optimizer.h): every layout's AdamW, its state kept as the
//     units' chunks (FusedAdamW's kernel on them, element for element), the norm summed over every
//     rank's chunks, checkpoints and the saved model in the unsplit format gathered one unit at a
//     time; gather_weights() gathers every unit for an evaluation.
// A model split over a tensor-parallel group is sharded the same way: each rank's units are its
// slices, sharded over its data-parallel group.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/model/gpt2.h"
#include "harness/train/step/build_step.h"
#include "harness/train/step/forward_backward.h"
#include "harness/train/step/step_optimizer.h"
#include "harness/zero/sharded_units.h"

namespace harness::zero {

// GPT-2's units: 0 the embeddings with ln_f and the tied head (wte's two uses summed by autograd
// into one accumulation, at the end of the backward), then block i as unit i + 1.
std::vector<ShardedUnit> gpt2_units(model::GPT2LMHeadModel& model);

// The order a training step uses the units in: 0, the blocks, 0 (the head), then the blocks
// from the last to the first (their backward).
std::vector<size_t> zero3_use_order(int64_t n_layer);

// The units of pipeline stages that are processes (`held`: the parameters this process's stages
// use, pipeline_forward_backward.h): each block's parameters held here (a block cut between two
// stages: this stage's part of it), the tied wte alone (so that the first and the last stage's
// chunks of it are the same elements, summed over the embedding group), and the rest held here
// (wpe on the first stage; ln_f on the last) together. One accumulation per micro-batch each
// (P > 1: the first and the last stage are never one process's).
std::vector<ShardedUnit> stage_units(model::GPT2LMHeadModel& model, const std::vector<std::string>& held);
// The unit of `units` that is the tied wte alone (stage_units), if any.
std::optional<size_t> tied_wte_unit(const ShardedUnits& units);

// Pipeline stages (`stages`) under ZeRO-3, as torchtitan runs FSDP inside pipeline stages: every
// unit of this process's stages is gathered before a step's first micro-batch and kept through
// its schedule, since 1F1B runs a micro-batch's forward between others' backwards. A unit's
// gradients are reduce-scattered as soon as its last micro-batch's backward completes them, and
// its full weights let go then. Evaluation and generation gather every unit for their run.
std::unique_ptr<train::ForwardBackward> gathered_stages(std::unique_ptr<train::ForwardBackward> stages,
                                                 ShardedUnits& units);

// The step's three parts for `model` (whole or this rank's tensor-parallel slices, on this rank's
// device, the same weights on every rank of `data`) sharded over `data`: the units (the step's
// synchronizer), the forward-backward that gathers them, and AdamW on their chunks; `prefetch` >= 0
// units gathered ahead (--zero_prefetch).
train::StepParts make_zero3(model::GPT2LMHeadModel model, const data_parallel::DistContext& data,
                             const train::OptimizerSettings& settings, int prefetch);

}  // namespace harness::zero
