// Bucketed, overlapped gradient averaging (as PyTorch's DDP reducer does it): parameters are
// grouped into buckets of about bucket_cap_mb in reverse registration order (the order backward
// produces gradients); a hook on each parameter's gradient accumulator marks it ready, and as soon
// as a bucket is complete its flattened SUM all-reduce starts asynchronously while backward goes
// on. finalize() waits, divides by the world size and writes the averages back into .grad().
// Where a step accumulates each gradient several times before it is complete (a pipeline
// schedule's micro-batches: set_expected_accumulations), a parameter is ready at its last.
// With AllReduceAlgorithm::kRing the buckets' ring all-reduces run, in bucket order, on a
// communication thread this object owns (RingAllReduceThread), so they overlap backward as well.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "harness/data_parallel/grad_sync.h"

namespace torch::autograd {
struct Node;
}

namespace harness::data_parallel {

// Where a tensor laid out at [offset, offset + n) of a flat buffer cut into equal chunks meets
// `rank`'s chunk [rank * chunk, (rank + 1) * chunk) (pure): the overlap's start in the chunk and
// in the tensor (flattened), and its length (0: they do not meet).
struct ChunkOverlap {
  int64_t in_chunk = 0, in_tensor = 0, length = 0;
};
ChunkOverlap chunk_overlap(int64_t rank, int64_t chunk, int64_t offset, int64_t n);

// The bucket plan (pure): indices of `parameters` that require grad, in reverse order, cut into
// consecutive buckets of at most cap_bytes (a larger parameter gets a bucket of its own) and
// wherever dtype or device changes.
std::vector<std::vector<size_t>> plan_buckets(const std::vector<at::Tensor>& parameters,
                                              int64_t cap_bytes);
// `plan` with each index of `apart` in a bucket of its own: a bucket holding one is cut before
// and after it (the order of the indices is kept).
std::vector<std::vector<size_t>> keep_apart_in_plan(const std::vector<std::vector<size_t>>& plan,
                                                    const std::vector<size_t>& apart);

// Over Gloo: rank r receives part r of every rank's `input` into `output`, in rank order (equal
// parts). Gloo's reduce-scatter and all-gather are slower than this (see their callers).
c10::intrusive_ptr<c10d::Work> all_to_all_even(c10d::Backend& group, at::Tensor& output, at::Tensor& input);

// A hook on `parameter`'s gradient accumulator that calls owner->add(index) after each
// accumulation into its .grad(); the node (kept alive, or autograd would make a new one without
// the hook) and the key that removes it.
std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t> hook_gradient_accumulator(const at::Tensor& parameter,
                                                                                      GradientSynchronizer* owner,
                                                                                      size_t index);

// What a bucket's collective leaves on each rank: the whole average (DDP), or the rank's chunk of
// it (reduce-scatter: each rank steps only that chunk; zero/zero.h decides which ZeRO stage uses
// which). kShardedGradients is ZeRO-2's: as kReduceScatter, but each parameter's .grad() is let go as soon as it is copied into its
// bucket, each bucket's buffers as soon as its reduce-scatter is done, and every finalize() adds
// its average into the chunk, so a rank keeps 1/N of the gradients plus the buckets in flight, and
// gradient accumulation accumulates into the chunk (finalize() after each batch).
enum class GradientReduction { kAllReduce, kReduceScatter, kShardedGradients };

class BucketedAllReduce : public GradientSynchronizer {
 public:
  // kReduceScatter: bucket b's flattened gradients, zero-padded to a multiple of the world size,
  // are reduce-scattered; finalize() leaves this rank's chunk of the average in gradient_shard(b)
  // and the parameters' .grad() as they were (local). It needs the builtin collectives (not
  // --allreduce ring) and every parameter to get a gradient on some rank in every step.
  explicit BucketedAllReduce(DistContext ctx, double bucket_cap_mb = 25.0,
                             AllReduceAlgorithm allreduce = AllReduceAlgorithm::kBuiltin,
                             GradientReduction reduction = GradientReduction::kAllReduce);
  ~BucketedAllReduce() override;  // removes its hooks
  BucketedAllReduce(const BucketedAllReduce&) = delete;
  BucketedAllReduce& operator=(const BucketedAllReduce&) = delete;

  // Parameters must be leaves; those that do not require grad are skipped. Call once.
  using GradientSynchronizer::attach;
  void attach(std::vector<at::Tensor> parameters) override;
  // Called by the accumulator hooks; public so that a caller without hooks could drive it.
  void add(size_t index) override;
  // Launches what backward did not (unused parameters count as zero), waits for every bucket,
  // then agrees with the other ranks (one small MAX all-reduce) on the buckets to reduce again
  // and the parameters that have a gradient anywhere, and averages. Ranks may use different
  // parameters in a step (as DDP's find_unused_parameters allows): a parameter used on any rank
  // gets the average everywhere. Parameters unused in one step are taken as ready from the start
  // of the next, so they do not delay their bucket; a gradient accumulated after its bucket was
  // launched (several backward calls per step, or a parameter used again) makes that bucket be
  // reduced again here, in bucket order on every rank.
  void finalize() override;
  std::string name() const override {
    return allreduce_ == AllReduceAlgorithm::kRing ? "bucketed+ring" : "bucketed";
  }

  const std::vector<std::vector<size_t>>& bucket_plan() const { return plan_; }
  // Buckets whose all-reduce started during backward in the last finalized step.
  int64_t launched_during_backward() const { return launched_during_backward_; }
  // Buckets whose all-reduce has started so far in the current step (before finalize()).
  int64_t launched_in_step() const;

  // kReduceScatter: the elements of bucket b (its parameters flattened in bucket_plan() order), the
  // chunk each rank owns (ceil(elements / world size)), and after finalize() this rank's chunk of
  // the averaged gradient (fp32; past the bucket's end, zeros). kShardedGradients: the sum of the
  // averages of every finalize() since discard_shards().
  int64_t bucket_elements(size_t b) const;
  int64_t chunk_elements(size_t b) const;
  const at::Tensor& gradient_shard(size_t b) const;
  // kReduceScatter's inverse layout: all-gathers every rank's `chunk` of bucket b (collective) and
  // returns the parts of the result that belong to the bucket's parameters, in bucket_plan() order,
  // each a view shaped like its parameter.
  std::vector<at::Tensor> gather_bucket(size_t b, const at::Tensor& chunk) const;
  // Before attach(): `parameter` gets a bucket of its own, so that its chunks are the same
  // elements on every group of this size, whatever else each group synchronises (a tied weight's
  // copy on another pipeline stage: its chunk can then be summed with this one's).
  void keep_apart(const at::Tensor& parameter);
  // kReduceScatter, after finalize(): this rank's chunk of the averaged gradient of a parameter
  // kept apart (its elements [rank * chunk, (rank + 1) * chunk), zeros past its end).
  const at::Tensor& gradient_shard_of(const at::Tensor& parameter) const;
  // kShardedGradients: the chunks start again from nothing (an optimizer step's zero_grad).
  void discard_shards();
  bool reduces_every_batch() const override { return reduction_ == GradientReduction::kShardedGradients; }
  // The same in two halves, so that several gathers are in flight at once: start_gather launches
  // the all-gather (collective), finish_gather waits for it and returns the views.
  struct BucketGather {
    size_t bucket = 0;
    at::Tensor all;
    at::Tensor send;  // over Gloo: the chunk once per rank, sent by an all-to-all
    c10::intrusive_ptr<c10d::Work> work;
  };
  BucketGather start_gather(size_t b, const at::Tensor& chunk) const;
  std::vector<at::Tensor> finish_gather(BucketGather& gather) const;
  const DistContext& context() const { return ctx_; }
 private:
  struct Bucket {
    std::vector<size_t> params;
    size_t pending = 0;      // parameters not yet ready this step
    bool launched = false;
    bool stale = false;      // a gradient changed after the launch
    at::Tensor buffer;       // the flattened gradients being reduced
    bool settled = false;    // reduce-scatter: its result folded into `shard`, its buffers let go
    at::Tensor scattered;    // reduce-scatter over NCCL: this rank's chunk of the sum
    at::Tensor received;     // reduce-scatter over Gloo: every rank's copy of this rank's chunk
    at::Tensor shard;        // reduce-scatter: this rank's chunk of the average (gradient_shard)
    c10::intrusive_ptr<c10d::Work> work;
  };

  void launch_ready_buckets_locked();
  void launch_locked(Bucket& bucket);
  // Reduce-scatter: waits for the bucket's collective, folds this rank's averaged chunk into its
  // shard (replacing it; adding to it with kShardedGradients) and lets the buffers go.
  void settle_locked(Bucket& bucket);
  bool scatters() const { return reduction_ != GradientReduction::kAllReduce; }
  void reset_step_locked();

  DistContext ctx_;
  AllReduceAlgorithm allreduce_;
  GradientReduction reduction_;
  std::unique_ptr<RingAllReduceThread> ring_;  // with kRing: where the buckets are reduced
  int64_t cap_bytes_;
  std::vector<at::Tensor> apart_;   // parameters given buckets of their own (keep_apart)
  std::vector<at::Tensor> parameters_;
  std::vector<std::vector<size_t>> plan_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;   // parameter index -> bucket (SIZE_MAX: not synchronised)
  std::vector<char> ready_;          // counted towards its bucket this step (fired or presumed unused)
  std::vector<char> fired_;          // its accumulator hook ran this step
  std::vector<char> had_gradient_;   // kShardedGradients: its .grad() was taken into a bucket this step
  std::vector<int64_t> accumulated_;  // its hook's runs this step outside no_sync, up to ready
  size_t next_to_launch_ = 0;       // buckets launch strictly in order, the same on every rank
  int64_t launched_in_step_ = 0;
  int64_t launched_during_backward_ = 0;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
  mutable std::mutex mutex_;
};

}  // namespace harness::data_parallel
