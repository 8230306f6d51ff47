// Gradient synchronisation for data parallelism behind one interface (STYLE.md §5): attach the
// parameters once, let backward produce gradients (an implementation may start reducing them as
// each becomes ready), then finalize() before the optimizer step leaves every attached
// parameter's .grad() equal to the mean over the ranks. Callers never change with the strategy.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <atomic>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/data_parallel/ring_all_reduce.h"

namespace harness::data_parallel {

class GradientSynchronizer {
 public:
  virtual ~GradientSynchronizer() = default;

  // The parameters whose gradients are averaged, in registration order. Call once, before the
  // first backward (implementations that overlap communication install their hooks here).
  void attach(torch::nn::Module& module) { attach(module.parameters(/*recurse=*/true)); }
  virtual void attach(std::vector<at::Tensor> parameters) = 0;

  // Gradient of attached parameter `index` is complete (accumulated) for this step. Overlapping
  // implementations call this from their own hooks; others ignore it.
  virtual void add(size_t index) {}

  // After backward, before the optimizer step: waits for every reduction and writes the averaged
  // gradients. The ranks agree first on which parameters have a gradient: one that has it on any
  // rank gets the mean on every rank (zeros for the ranks without), one that has it on none is
  // left without. Every rank issues the same collectives whatever its own gradients.
  virtual void finalize() = 0;

  virtual std::string name() const = 0;
  // Whether each batch's gradients are reduced as they come, finalize() following every batch
  // of a step (ZeRO-2 accumulates into each rank's shard and lets the full gradients go), instead
  // of accumulating locally under no_sync until the last.
  virtual bool reduces_every_batch() const { return false; }

  // DDP's no_sync: while set, backward only accumulates gradients locally (no hook starts a
  // reduction); the next finalize() reduces what was accumulated. Gradient accumulation sets it
  // for every micro-step but the last, so that a step communicates once.
  void set_no_sync(bool no_sync) { no_sync_ = no_sync; }
  bool no_sync() const { return no_sync_; }

  // How many times each attached parameter's gradient accumulates in the backward passes that
  // synchronise (those outside no_sync) before the next finalize(): 1 for one backward, M for a
  // pipeline schedule's M micro-batch backward passes. An overlapping implementation starts a
  // parameter's reduction only after its last; the others ignore it. The step's forward-backward
  // part says how many (ForwardBackward::gradient_accumulations).
  void set_expected_accumulations(int64_t accumulations) {
    if (accumulations < 1) {
      throw std::invalid_argument("GradientSynchronizer: expected gradient accumulations must be >= 1, got " +
                                  std::to_string(accumulations));
    }
    expected_accumulations_ = accumulations;
  }
  int64_t expected_accumulations() const { return expected_accumulations_; }

  // Bytes this rank has put into gradient all-reduces so far (gradients, buckets reduced again,
  // agreement flags): what the benchmarks count per optimizer step.
  int64_t communicated_bytes() const { return communicated_bytes_; }
  // finalize() calls so far: the optimizer steps those bytes served.
  int64_t finalized_steps() const { return finalized_steps_; }

  // --grad_reduce_dtype: the dtype gradients are all-reduced in (nullopt: their own, fp32). bf16
  // halves the bytes on the wire; each gradient is rounded to bf16's 8-bit mantissa, and so is
  // every partial sum the collective forms (where values cancel, the relative error of the sum can
  // be large); the average is then taken and written back in the gradients' dtype.
  void set_reduce_dtype(std::optional<at::ScalarType> dtype) { reduce_dtype_ = dtype; }
  std::optional<at::ScalarType> reduce_dtype() const { return reduce_dtype_; }

 protected:
  std::atomic<bool> no_sync_{false};
  std::atomic<int64_t> expected_accumulations_{1};
  std::atomic<int64_t> communicated_bytes_{0};
  std::atomic<int64_t> finalized_steps_{0};
  std::optional<at::ScalarType> reduce_dtype_;
};

// The original's average_gradients: after backward, one blocking SUM all-reduce per parameter
// that has a gradient on any rank (agreed first), then division by the world size (no autograd involved, never .data()).
// `allreduce` picks the process group's collective or the ring on send/recv.
class NaiveAllReduce : public GradientSynchronizer {
 public:
  explicit NaiveAllReduce(DistContext ctx,
                          AllReduceAlgorithm allreduce = AllReduceAlgorithm::kBuiltin);
  using GradientSynchronizer::attach;
  void attach(std::vector<at::Tensor> parameters) override;
  void finalize() override;
  std::string name() const override {
    return allreduce_ == AllReduceAlgorithm::kRing ? "naive+ring" : "naive";
  }

 private:
  DistContext ctx_;
  AllReduceAlgorithm allreduce_;
  std::vector<at::Tensor> parameters_;
};

// The same in one call, as the original's function of that name.
void average_gradients(torch::nn::Module& module, const DistContext& ctx);

// --grad_sync: naive (NaiveAllReduce, per parameter after the backward) or bucketed
// (BucketedAllReduce with --bucket_cap_mb, bucketed_all_reduce.h, overlapped with the backward).
enum class GradientSyncKind { kNaive, kBucketed };

// "naive" / "bucketed"; anything else throws std::invalid_argument naming --grad_sync.
GradientSyncKind parse_gradient_sync(const std::string& name);
std::string to_string(GradientSyncKind kind);

// The synchronizer of `kind`, reducing with --allreduce (builtin or ring).
std::unique_ptr<GradientSynchronizer> make_gradient_synchronizer(
    GradientSyncKind kind, const DistContext& ctx, double bucket_cap_mb = 25.0,
    AllReduceAlgorithm allreduce = AllReduceAlgorithm::kBuiltin);

}  // namespace harness::data_parallel
