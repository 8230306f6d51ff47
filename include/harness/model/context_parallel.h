// Context parallelism: each sequence is split over the C ranks of a context group in the zigzag
// order (rank c holds chunks c and 2C-1-c of 2C equal chunks, so causal attention's work is even),
// and attention becomes ring attention. The model area knows no process group; the
// context-parallel area implements ContextParallelGroup over one
// (context_parallel::make_context_parallel_group).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace harness::model {

// ----- The zigzag split (pure) -------------------------------------------------------------------
//
// S = 8, C = 2: four chunks of L = 2 positions.
//
//   chunk      0      1      2      3
//   positions  0 1 | 2 3 | 4 5 | 6 7
//   rank       0     1     1     0        rank 0: [0 1 6 7], rank 1: [2 3 4 5]

// Throws std::invalid_argument naming the sequence length, C and 2C when the length does not
// split into 2C equal chunks, or C < 1.
void check_zigzag_split(int64_t sequence_length, int context_parallel_size);

// The two chunks rank `rank` holds, in its shard's order: {rank, 2C-1-rank}.
std::pair<int64_t, int64_t> zigzag_chunks(int context_parallel_size, int rank);

// The token positions rank `rank` holds, in its shard's order (chunk rank, then chunk 2C-1-rank).
std::vector<int64_t> zigzag_positions(int64_t sequence_length, int context_parallel_size, int rank);

// Rank `rank`'s shard of `x`: its two chunks of dimension `dim`, concatenated along `dim`.
at::Tensor zigzag_shard(const at::Tensor& x, int64_t dim, int context_parallel_size, int rank);

// The whole tensor from every rank's shard, in rank order (the inverse of zigzag_shard).
at::Tensor zigzag_unshard(const std::vector<at::Tensor>& shards, int64_t dim);

// ----- The group ---------------------------------------------------------------------------------

// The ranks that together hold one sequence, seen from one of them. Ranks are local to the group.
class ContextParallelGroup {
 public:
  // One ring step in flight: this rank's tensor on its way to the next rank, the previous rank's
  // tensor of the same shape and dtype on its way here.
  class Exchange {
   public:
    virtual ~Exchange() = default;
    // Blocks until both transfers are done (on CUDA: until the current stream is ordered after
    // them); returns the tensor received from the previous rank.
    virtual at::Tensor wait() = 0;
  };

  virtual ~ContextParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Starts sending `to_next` to rank (rank + 1) mod size and receiving from (rank - 1) mod size;
  // returns at once. Every rank of the group must start its exchanges in the same order; two may
  // be in flight at once. On a group of one, the tensor comes back (a copy).
  virtual std::unique_ptr<Exchange> ring_exchange(const at::Tensor& to_next) = 0;
  // In-place sum over the group, outside autograd (the loss normalisation's token counts).
  virtual void all_reduce_sum(at::Tensor& x) = 0;
  // Every rank's x in rank order, outside autograd (gathering a sequence's shards).
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& x) = 0;
};

// ----- Ring attention ----------------------------------------------------------------------------

// Causal attention softmax(Q K^T * scale) V over the whole sequence, computed from this rank's
// zigzag shards: q, k and v are [B, H, 2L, D] (chunk c, then chunk 2C-1-c, L = S / 2C); returns
// this rank's shard of the output, in q's dtype. K and V travel round the ring (the next block's
// exchange overlaps the current block's compute); partial results merge by their log-sum-exp in
// fp32, whatever the input dtype. The backward is the ring backward: dK and dV travel with their
// K and V and arrive back at their owner. Both passes are collective: every rank of `group` calls
// them in the same order, and `group` must outlive the backward. No double backward.
//
// dropout_p > 0: each block's keep-mask is drawn from `generator` (the device's default one when
// absent) in the forward and kept for the backward; dropout scales the normalised probabilities,
// so it commutes with the online-softmax rescaling. The masks are drawn block by block, in ring
// order, on each rank's own generator: the same seed does not give the masks a one-device
// attention would draw.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, ContextParallelGroup& group,
                          double scale, double dropout_p = 0, std::optional<at::Generator> generator = {});

// ring_attention and the keep-mask it drew, for checks against an explicit reference:
// keep_mask is bool [B, H, 2L, S], this rank's query rows (shard order) against every key position
// (sequence order), false where causality forbids; with dropout_p 0, the causal pattern alone.
struct RingAttentionWithMask {
  at::Tensor output;
  at::Tensor keep_mask;
};
RingAttentionWithMask ring_attention_with_keep_mask(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    ContextParallelGroup& group, double scale, double dropout_p,
                                                    std::optional<at::Generator> generator = {});

// How a causal block of (query chunk, key chunk) is computed: not at all (the keys are all in the
// queries' future), in full (all in the past), or its lower triangle (the same chunk).
enum class CausalBlock { kSkip, kFull, kDiagonal };
CausalBlock causal_block(int64_t query_chunk, int64_t key_chunk);

}  // namespace harness::model
