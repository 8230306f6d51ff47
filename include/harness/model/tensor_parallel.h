// Tensor parallelism as a property of GPT-2's linear layers (Megatron's column- and row-parallel
// styles): the arithmetic of splitting a parameter over T ranks, and the few operations a split
// model needs from its group. The model area knows no process group; the tensor-parallel area
// implements TensorParallelGroup over one (tensor_parallel::make_tensor_parallel_group).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace harness::model {

struct GPT2Config;

// How a parameter of the unsplit model is spread over the tensor-parallel ranks.
struct ShardSpec {
  // kBalancedRows: the first dimension split as evenly as it goes when it does not divide (the
  // vocabulary of the tied wte and head: GPT-2's 50257 rows): the first extent % T ranks hold one
  // row more than the others (see vocabulary_range).
  enum class Kind { kReplicated, kColumns, kRows, kBalancedRows };
  Kind kind = Kind::kReplicated;
  // kColumns: the output dimension is `fused_parts` equal blocks fused side by side (GPT-2's
  // c_attn packs [q | k | v]: 3); each block is split over the ranks on its own, so rank t holds
  // block p's t-th slice for every p, in block order.
  int64_t fused_parts = 1;
  // The dimension that is split: kColumns the last one, kRows and kBalancedRows the first; -1 for
  // kReplicated.
  int64_t split_dim(int64_t dims) const;
};

// Rank `rank`'s shard of an unsplit tensor, and the unsplit tensor from every rank's shard
// (pure). Errors name the shape, the split and the number of ranks when they do not divide
// (kBalancedRows: when there are fewer rows than ranks).
at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int rank, int world_size);
at::Tensor unshard_tensor(const std::vector<at::Tensor>& shards, const ShardSpec& spec);

// The ranges of the unsplit dimension that rank `rank` holds, in the order its shard has them:
// (start, length) pairs, one per fused part (what a file reader needs to read a shard alone).
std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t extent, const ShardSpec& spec, int rank,
                                                      int world_size);

// The ids of a vocabulary of `vocab_size` that rank `rank` of `world_size` holds: [start, end).
// Balanced: vocab_size / world_size ids each, one more on the first vocab_size % world_size ranks
// (50257 over 2: [0, 25129) and [25129, 50257)), so no rank is ever left without an id and none
// holds more than one row beyond another. Throws when vocab_size < world_size.
struct VocabularyRange {
  int64_t start = 0, end = 0;
  int64_t size() const { return end - start; }
};
VocabularyRange vocabulary_range(int64_t vocab_size, int rank, int world_size);

// Throws std::invalid_argument with the numbers when n_head or the MLP's inner size is not
// divisible by tensor_parallel_size, when the vocabulary has fewer ids than ranks (the tied head
// is split over it), or when the config itself is invalid.
void validate_tensor_parallel(const GPT2Config& config, int tensor_parallel_size);

// The ranks that together hold one model replica, seen from one of them.
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Megatron's f: the identity forward; backward, the sum of the gradients over the group
  // (the input of a column-parallel layer is replicated, its gradient is partial on each rank).
  virtual at::Tensor copy_to_region(const at::Tensor& x) = 0;
  // Megatron's g: forward, the sum over the group (a row-parallel layer's partial products);
  // the identity backward.
  virtual at::Tensor reduce_from_region(const at::Tensor& x) = 0;
  // Every rank's x in rank order, outside autograd (gathering shards to save or compare).
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& x) = 0;
  // Sequence parallelism (Megatron's): activations split along dimension `dim` (the rows or the
  // sequence) into T equal parts, rank t holding part t.
  //   gather_sequence          forward: every rank's part, joined along dim in rank order;
  //                            backward: the gradient summed over the group, this rank's part kept.
  //   reduce_scatter_sequence  forward: x (whole along dim, a partial sum on each rank) summed over
  //                            the group, this rank's part kept; backward: the gradient's parts joined.
  // The first replaces copy_to_region before a column-parallel layer, the second
  // reduce_from_region after a row-parallel one. reduce_scatter_sequence throws when dim's extent
  // is not divisible by the group's size.
  virtual at::Tensor gather_sequence(const at::Tensor& x, int64_t dim) = 0;
  virtual at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim) = 0;
  // The element-wise reduction of every rank's x (same shape on all), outside autograd: a new
  // tensor, x left as it was (the vocabulary-parallel loss's maxima and sums).
  enum class ReduceOp { kSum, kMax, kMin };
  virtual at::Tensor all_reduce(const at::Tensor& x, ReduceOp op) = 0;
  // fn with `device`'s default generator switched to this rank's own stream, for dropout on
  // activations that exist on this rank alone (its heads' attention probabilities); the default
  // generator, which must agree over the group, is left as it was.
  virtual at::Tensor run_in_rank_stream(const c10::Device& device, const std::function<at::Tensor()>& fn) = 0;
  // Those streams by device name ("cpu", "cuda:0"), for checkpoints, and their replacement.
  virtual std::map<std::string, at::Tensor> rank_stream_states() const = 0;
  virtual void set_rank_stream_states(const std::map<std::string, at::Tensor>& states) = 0;
};

}  // namespace harness::model
