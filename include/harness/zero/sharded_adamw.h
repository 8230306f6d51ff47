// ZeRO stage 1 (--zero_stage 1), as DeepSpeed's ZeRO-1 and PyTorch's ZeroRedundancyOptimizer: each
// data-parallel rank keeps AdamW's two moments only for its chunk of every gradient bucket (the
// bucket's parameters flattened; BucketedAllReduce in kReduceScatter mode hands it the averaged
// gradient of that chunk, reduce-scattered and overlapped with backward), steps that chunk, and
// all-gathers the updated chunks into every rank's parameters. The update is the replicated step's
// kernel (optim::FusedAdamW's, element for element), so a sharded run takes the replicated run's
// steps.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/optim/fused_adamw.h"

namespace harness::zero {

using data_parallel::BucketedAllReduce;

using optim::AdamWHyperparameters;  // torch::optim::AdamWOptions' defaults

class ShardedAdamW {
 public:
  // `gradients` is the reduce-scattering synchronizer already attached to `parameters` (the same
  // list, in the same order).
  ShardedAdamW(const BucketedAllReduce& gradients, std::vector<at::Tensor> parameters, AdamWHyperparameters options);

  // After gradients.finalize(): one AdamW step on this rank's chunks, then one all-gather per
  // bucket writes every rank's updated chunk into the parameters. Collective.
  void step();

  // The full state, per parameter (in `parameters` order): exp_avg and exp_avg_sq with the
  // parameter's shape on the CPU, and the steps taken. Collective (all-gathers the chunks).
  struct FullState {
    int64_t step = 0;
    std::vector<std::pair<at::Tensor, at::Tensor>> moments;  // empty before the first step
  };
  FullState gather_state() const;
  // Bucket b's part of it: each of its parameters' two moments (in bucket_plan() order), shaped
  // like the parameter, on its device. Collective; one bucket at a time, for streamed checkpoints.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> gather_bucket_moments(size_t b) const;
  // Takes this rank's chunks of a full state (shapes checked, naming the parameter index).
  void load_state(const FullState& state);

  // The rate of the following steps.
  void set_learning_rate(double lr) { options_.lr = lr; }
  double learning_rate() const { return options_.lr; }
  int64_t steps() const { return step_; }
  // Every tensor step() writes (the parameters and this rank's chunks of both moments), and the
  // step count to set back: what optimizer post-validation keeps to undo a step.
  std::vector<at::Tensor> written_by_step() const;
  void set_steps(int64_t steps) { step_ = steps; }
  // Bytes of optimizer state this rank holds (its chunks of the two moments).
  int64_t state_bytes() const;
  // Bytes this rank put into the parameter all-gathers so far.
  int64_t gathered_bytes() const { return gathered_bytes_; }

 private:
  struct Piece {  // the part of a parameter inside this rank's chunk of its bucket
    size_t parameter;
    int64_t parameter_offset, chunk_offset, length;
  };
  struct Shard {
    size_t bucket;
    int64_t chunk;  // elements per rank
    std::vector<Piece> pieces;
    at::Tensor exp_avg, exp_avg_sq;
  };

  const BucketedAllReduce& gradients_;
  std::vector<at::Tensor> parameters_;
  AdamWHyperparameters options_;
  std::vector<Shard> shards_;
  int64_t step_ = 0;
  int64_t gathered_bytes_ = 0;
};

}  // namespace harness::zero
