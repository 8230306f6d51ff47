// ZeRO stage 3 (--zero_stage 3), as DeepSpeed's ZeRO-3 and PyTorch's FSDP shard it: the model's
// parameters are cut into units (for GPT-2, each transformer block, and the embeddings with the
// final norm and the tied head), and each data-parallel rank keeps only a flat 1/N of every unit
// (its "chunk": the unit's parameters flattened in order, zero-padded to a multiple of N), with
// the chunk's gradient and AdamW moments. A unit's full parameters exist only between gather()
// and release(): the model's parameters are views of one full buffer per unit whose storage is
// taken (from a pool of the buffers let go, by size) and all-gathered on gather() and given back
// to the pool on release(), in place, so that what autograd
// saved of them in forward reads the regathered values in backward. A unit's gradients are
// reduce-scattered into the chunks as soon as every parameter of it has had its accumulations of
// the backward (its full gradients and weights then let go). Which unit is gathered when (and
// how far ahead) is the caller's schedule (train/zero3_step.h); this holds the storage and the
// collectives.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/process_group.h"

namespace torch::autograd {
struct Node;
}

namespace harness::zero {

using data_parallel::DistContext;

struct ShardedUnit {
  std::string name;                    // e.g. "h.3"
  std::vector<std::string> names;      // its parameters' names, in order
  std::vector<at::Tensor> parameters;  // leaves, fp32, one device
  // Gradient accumulations each parameter gets in one backward: 1 (autograd sums a weight's uses
  // within one backward, as GPT-2's tied wte's by the embedding and the head, before accumulating
  // it); more where one step runs several backward passes through it.
  std::vector<int64_t> accumulations;
};

class ShardedUnits final : public data_parallel::GradientSynchronizer {
 public:
  // Every rank passes the same units with the same values (rank 0's, broadcast): each keeps its
  // chunks of them, and the parameters become views of full copies, released.
  ShardedUnits(DistContext ctx, std::vector<ShardedUnit> units);
  ~ShardedUnits() override;
  ShardedUnits(const ShardedUnits&) = delete;
  ShardedUnits& operator=(const ShardedUnits&) = delete;

  size_t size() const { return units_.size(); }
  const ShardedUnit& unit(size_t u) const { return units_.at(u).spec; }
  // Bytes of unit u's full copy (padded to world size x chunk).
  int64_t full_bytes(size_t u) const { return units_.at(u).full.numel() * static_cast<int64_t>(units_.at(u).full.element_size()); }
  const DistContext& context() const { return ctx_; }

  // Unit u's full parameters: gather() starts the all-gather (nothing if they are here or on the
  // way), wait() returns once they are here (gathering them first if needed), release() frees
  // them. Collective: every rank gathers the same units in the same order.
  void gather(size_t u);
  void wait(size_t u);
  void release(size_t u);
  bool gathered(size_t u) const;
  // Every unit gathered and kept until release_all() (evaluation and saving the model).
  void gather_all();
  void release_all();
  // Bytes of full parameter copies allocated now, and the most since reset_peak() outside
  // gather_all() (what training's schedule held at once).
  int64_t live_bytes() const;
  int64_t peak_bytes() const;
  void reset_peak();
  // Bytes kept for reuse: the unit-sized buffers (full parameters, the gradients' reduce-scatter
  // buffers) let go and not yet taken again. Each step takes and gives back the same sizes in
  // the same order, so that they are allocated once, not freed and allocated again every unit
  // (which, on a CPU, fragments the heap: the resident set grew by about two units per unit).
  int64_t pooled_bytes() const;

  // GradientSynchronizer. attach() is refused: the units are given at construction.
  void attach(std::vector<at::Tensor> parameters) override;
  void add(size_t index) override;
  // Launches the reduce-scatter of every unit backward did not complete (missing gradients as
  // zeros), waits for all, and adds each rank's averaged chunk into its gradient chunk.
  void finalize() override;
  std::string name() const override { return "zero3"; }
  bool reduces_every_batch() const override { return true; }

  // This rank's chunks of unit u: the weights (what AdamW steps), and the gradient accumulated
  // since discard_gradients() (zeros before any).
  int64_t chunk_elements(size_t u) const { return units_.at(u).chunk; }
  at::Tensor& weight_chunk(size_t u) { return units_.at(u).weights; }
  const at::Tensor& gradient_chunk(size_t u) const { return units_.at(u).gradient; }
  void discard_gradients();
  // The offset of parameter k of unit u in the unit's flat layout.
  int64_t offset_of(size_t u, size_t k) const { return units_.at(u).offsets.at(k); }
  // Every rank's `chunk` of unit u together (collective), as one view per parameter, shaped like it.
  std::vector<at::Tensor> gather_unit(size_t u, const at::Tensor& chunk) const;
  // This rank's part of `full` (parameter k of unit u, its shape) copied into `chunk` (its elements
  // in this rank's range of the unit; the rest of `chunk` untouched).
  void copy_into_chunk(size_t u, size_t k, const at::Tensor& full, at::Tensor& chunk) const;

 private:
  struct Unit {
    ShardedUnit spec;
    std::vector<int64_t> offsets;
    int64_t elements = 0, chunk = 0;
    at::Tensor full;      // the full flat copy; its storage is allocated only while gathered
    at::Tensor weights, gradient;
    bool here = false;    // storage allocated and filled (or being filled)
    bool kept = false;    // gather_all(): not released until release_all()
    c10::intrusive_ptr<c10d::Work> gathering;
    at::Tensor gather_send;  // over Gloo: the chunk once per rank
    // The reduce-scatter of this backward's gradients.
    std::vector<int64_t> fired;
    size_t pending = 0;
    bool launched = false;
    at::Tensor buffer, received;
    c10::intrusive_ptr<c10d::Work> reducing;
  };
  // Unit-sized buffers let go, by size in bytes, for the next one of that size.
  at::DataPtr take_locked(size_t bytes, c10::Allocator* allocator);
  void give_locked(size_t bytes, at::DataPtr data);
  // `storage` given `bytes` of the pool (or newly allocated); its bytes given to the pool, returned.
  void fill_storage_locked(c10::StorageImpl& storage, size_t bytes);
  size_t empty_storage_locked(c10::StorageImpl& storage);
  at::Tensor pooled_empty_locked(int64_t numel, const at::TensorOptions& options);
  void recycle_locked(at::Tensor& tensor);

  void allocate_locked(Unit& unit);
  void free_locked(Unit& unit);
  void launch_reduce_locked(Unit& unit);
  void copy_into_chunk(const Unit& unit, size_t k, const at::Tensor& full, at::Tensor& chunk) const;
  void settle_reduce_locked(Unit& unit);
  void reset_backward_locked();

  DistContext ctx_;
  std::vector<Unit> units_;
  std::vector<std::pair<size_t, size_t>> index_;  // synchronizer index -> (unit, parameter)
  std::deque<Unit*> reducing_;  // units whose reduce-scatter is in flight, oldest first
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
  int64_t live_bytes_ = 0, peak_bytes_ = 0;
  std::map<size_t, std::vector<at::DataPtr>> pool_;
  int64_t pooled_bytes_ = 0;
  bool gathering_all_ = false;
  mutable std::mutex mutex_;
};

}  // namespace harness::zero
