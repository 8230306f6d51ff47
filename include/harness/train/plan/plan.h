// A run's plan: every choice that makes its parallel execution, in one value. The programs parse
// their flags into it once and validate it once; the launcher, the step's builder
// (step/build_step.h), the memory plan, checkpoints (whose manifest records it), elastic training
// and the reports all read it, and no other struct carries its sizes again.
//
//     sizes        world = D x C x T x P (D inferred), sequence parallelism over T
//     ZeRO         the stage and ZeRO-3's prefetch (zero/zero.h holds its rules)
//     pipeline     the schedule, micro-batches, virtual stages, the balance, activation checkpointing
//     gradients    how they are synchronised: the kind, the bucket size, the algorithm, the dtype
//     elastic      whether a lost replica ends the run, and the fewest replicas to go on with
//
// parallel::Layout is the plan's geometry: every rank's coordinates and groups.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <string>

#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/ring_all_reduce.h"
#include "harness/parallel/layout.h"
#include "harness/train/step/pipeline_forward_backward.h"

namespace harness::train {

// --zero_stage and --zero_prefetch.
struct ZeroChoice {
  int stage = 0;     // 0: replicated; 1: AdamW state sharded; 2: and the gradients; 3: and the parameters
  int prefetch = 1;  // ZeRO-3: units all-gathered ahead
};

// --grad_sync, --bucket_cap_mb, --allreduce and --grad_reduce_dtype.
struct GradientSyncChoice {
  data_parallel::GradientSyncKind kind = data_parallel::GradientSyncKind::kBucketed;
  double bucket_cap_mb = 25.0;
  data_parallel::AllReduceAlgorithm allreduce = data_parallel::AllReduceAlgorithm::kBuiltin;
  at::ScalarType reduce_dtype = at::kFloat;  // of the gradients' all-reduce (kFloat or kBFloat16)
};

struct Plan {
  int world_size = 1;              // --world_size (run_pipeline: one process)
  int tensor_parallel_size = 1;    // T: ranks that split each layer of a replica
  int context_parallel_size = 1;   // C: ranks that split each sequence (ring attention)
  int pipeline_parallel_size = 1;  // P: pipeline stages as processes (run_pipeline's are its devices)
  bool sequence_parallel = false;  // T > 1: LayerNorm and dropout regions split along the sequence too
  ZeroChoice zero;
  PipelineScheduleConfig pipeline;  // how the stages run: P > 1, or run_pipeline's pipeline mode
  GradientSyncChoice gradient_sync;
  bool elastic = false;  // --elastic: a lost data-parallel replica does not end the run
  int min_replicas = 1;  // --min_replicas

  // D = world / (C x T x P); 0 where C x T x P does not divide the world (validate() says so).
  int data_parallel_size() const;
  // The ranks that hold the same slice of the model and average its gradients (ZeRO shards over
  // them): D x C.
  int gradient_group_size() const { return data_parallel_size() * context_parallel_size; }
  // The geometry: every rank's coordinates and groups. Throws std::invalid_argument naming the
  // flags for sizes below 1, a world C x T x P does not divide, or sequence parallelism without
  // T > 1. Under a V schedule (zbv) the last stage, with the loss, is on pipeline rank 0.
  parallel::Layout layout() const;
  // The sizes layout() is made of (elastic training's generations keep them, D changing).
  parallel::LayoutSizes layout_sizes() const;
  // Every rule of the plan, the flags named: layout(), then ZeRO's (zero::check_zero_rules), then
  // elastic training's replicas. Called once where a run starts, before any process does work.
  void validate() const;
};

// The plan as a checkpoint's manifest records it: each choice under its flag's name (and D as
// data_parallel_size), the balance as --balance would give it ("auto", "3,2.5,2.5" or "").
nlohmann::json plan_to_json(const Plan& plan);

}  // namespace harness::train
