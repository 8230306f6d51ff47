// The zigzag split and ring attention, forward and backward (see context_parallel.h).
#include "harness/model/context_parallel.h"

#include <torch/torch.h>

#include <array>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace harness::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string sizes_text(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

void check_rank(int context_parallel_size, int rank, const char* what) {
  if (rank < 0 || rank >= context_parallel_size) {
    throw std::invalid_argument(std::string(what) + ": rank " + std::to_string(rank) + " is not in [0, " +
                                std::to_string(context_parallel_size) + ") for --context_parallel_size " +
                                std::to_string(context_parallel_size));
  }
}

}  // namespace

// ----- The zigzag split --------------------------------------------------------------------------

void check_zigzag_split(int64_t sequence_length, int context_parallel_size) {
  if (context_parallel_size < 1) {
    throw std::invalid_argument("--context_parallel_size " + std::to_string(context_parallel_size) +
                                " must be at least 1");
  }
  const int64_t chunks = 2 * static_cast<int64_t>(context_parallel_size);
  if (sequence_length < 1 || sequence_length % chunks != 0) {
    throw std::invalid_argument("sequence length " + std::to_string(sequence_length) +
                                " is not divisible by 2 x --context_parallel_size " +
                                std::to_string(context_parallel_size) + " = " + std::to_string(chunks) +
                                " (the zigzag split gives each rank two equal chunks)");
  }
}

std::pair<int64_t, int64_t> zigzag_chunks(int context_parallel_size, int rank) {
  check_rank(context_parallel_size, rank, "zigzag_chunks");
  return {rank, 2 * static_cast<int64_t>(context_parallel_size) - 1 - rank};
}

std::vector<int64_t> zigzag_positions(int64_t sequence_length, int context_parallel_size, int rank) {
  check_zigzag_split(sequence_length, context_parallel_size);
  const int64_t chunk = sequence_length / (2 * context_parallel_size);
  const auto [first, second] = zigzag_chunks(context_parallel_size, rank);
  std::vector<int64_t> positions;
  positions.reserve(2 * chunk);
  for (int64_t c : {first, second}) {
    for (int64_t i = 0; i < chunk; ++i) positions.push_back(c * chunk + i);
  }
  return positions;
}

at::Tensor zigzag_shard(const at::Tensor& x, int64_t dim, int context_parallel_size, int rank) {
  dim = c10::maybe_wrap_dim(dim, x.dim());
  check_zigzag_split(x.size(dim), context_parallel_size);
  const int64_t chunk = x.size(dim) / (2 * context_parallel_size);
  const auto [first, second] = zigzag_chunks(context_parallel_size, rank);
  return at::cat({x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)}, dim);
}

at::Tensor zigzag_unshard(const std::vector<at::Tensor>& shards, int64_t dim) {
  if (shards.empty()) throw std::invalid_argument("zigzag_unshard: no shards");
  const int size = static_cast<int>(shards.size());
  dim = c10::maybe_wrap_dim(dim, shards.front().dim());
  for (int r = 0; r < size; ++r) {
    if (shards[r].sizes() != shards.front().sizes()) {
      throw std::invalid_argument("zigzag_unshard: rank " + std::to_string(r) + "'s shard has shape " +
                                  sizes_text(shards[r].sizes()) + ", rank 0's " +
                                  sizes_text(shards.front().sizes()));
    }
  }
  const int64_t length = shards.front().size(dim);
  if (length % 2 != 0) {
    throw std::invalid_argument("zigzag_unshard: a shard holds " + std::to_string(length) + " positions along dim " +
                                std::to_string(dim) + "; a zigzag shard holds two equal chunks");
  }
  const int64_t chunk = length / 2;
  std::vector<at::Tensor> chunks(2 * size);
  for (int r = 0; r < size; ++r) {
    const auto [first, second] = zigzag_chunks(size, r);
    chunks[first] = shards[r].narrow(dim, 0, chunk);
    chunks[second] = shards[r].narrow(dim, chunk, chunk);
  }
  return at::cat(chunks, dim);
}

CausalBlock causal_block(int64_t query_chunk, int64_t key_chunk) {
  if (key_chunk < query_chunk) return CausalBlock::kFull;
  return key_chunk == query_chunk ? CausalBlock::kDiagonal : CausalBlock::kSkip;
}

// ----- Ring attention ----------------------------------------------------------------------------

namespace {

// Who holds what during the ring: at step s this rank (c) holds the keys and values of rank
// (c - s) mod C, its "owner". A shard's half i is the owner's chunk zigzag_chunks(...)[i].
struct Ring {
  int rank = 0;
  int size = 1;

  int owner(int step) const { return ((rank - step) % size + size) % size; }
  static int64_t chunk(int size, int holder, int half) {
    const auto chunks = zigzag_chunks(size, holder);
    return half == 0 ? chunks.first : chunks.second;
  }
  CausalBlock block(int step, int query_half, int key_half) const {
    return causal_block(chunk(size, rank, query_half), chunk(size, owner(step), key_half));
  }
  // Where a block's keep-mask is kept between the forward and the backward.
  static size_t mask_index(int step, int query_half, int key_half) { return 4 * step + 2 * query_half + key_half; }
};

// Half `i` (a chunk of L positions) of a shard [..., 2L, D] along dim -2.
at::Tensor half_of(const at::Tensor& shard, int i) {
  const int64_t chunk = shard.size(-2) / 2;
  return shard.narrow(-2, i * chunk, chunk);
}

// Half `i` of per-query values [B, H, 2L] (the log-sum-exp, D).
at::Tensor rows_half_of(const at::Tensor& rows, int i) {
  const int64_t chunk = rows.size(-1) / 2;
  return rows.narrow(-1, i * chunk, chunk);
}

// Scores of a block, fp32, with -inf above the diagonal of a diagonal block.
at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, CausalBlock kind, double scale) {
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (kind == CausalBlock::kDiagonal) {
    const int64_t n = scores.size(-1);
    const at::Tensor future = at::ones({n, n}, scores.options().dtype(at::kBool)).triu_(1);
    scores.masked_fill_(future, -std::numeric_limits<double>::infinity());
  }
  return scores;
}

// Online softmax state of one query chunk: the output normalised over the blocks seen so far and
// their log-sum-exp, both fp32.
struct Partial {
  at::Tensor out;  // [B, H, L, D]
  at::Tensor lse;  // [B, H, L]

  void merge(const at::Tensor& block_out, const at::Tensor& block_lse) {
    if (!out.defined()) {
      out = block_out;
      lse = block_lse;
      return;
    }
    const at::Tensor merged = at::logaddexp(lse, block_lse);
    out = out * (lse - merged).exp().unsqueeze(-1) + block_out * (block_lse - merged).exp().unsqueeze(-1);
    lse = merged;
  }
};

// What the backward needs besides the tensors in save_for_backward.
struct RingState : torch::CustomClassHolder {
  ContextParallelGroup* group = nullptr;
  double scale = 1;
  double dropout_p = 0;
  at::Tensor lse;                       // fp32 [B, H, 2L]: the final log-sum-exp of each query
  std::vector<at::Tensor> keep_masks;   // by Ring::mask_index; undefined where not drawn
};

constexpr const char* kState = "ring_state";

// One ring step where two exchanges may be in flight: skipped on a group of one.
std::unique_ptr<ContextParallelGroup::Exchange> start_exchange(ContextParallelGroup& group, const at::Tensor& t) {
  return group.size() > 1 ? group.ring_exchange(t) : nullptr;
}

// keep_mask of ring_attention_with_keep_mask: each computed block's mask placed at its query
// rows and key columns; blocks never computed stay false.
at::Tensor assemble_keep_mask(const RingState& state, const Ring& ring, const at::Tensor& q) {
  const int64_t chunk = q.size(2) / 2;
  at::Tensor full = at::zeros({q.size(0), q.size(1), q.size(2), 2 * chunk * ring.size}, q.options().dtype(at::kBool));
  const at::Tensor lower = at::ones({chunk, chunk}, full.options()).tril_();
  for (int step = 0; step < ring.size; ++step) {
    for (int qi = 0; qi < 2; ++qi) {
      for (int kj = 0; kj < 2; ++kj) {
        const CausalBlock kind = ring.block(step, qi, kj);
        if (kind == CausalBlock::kSkip) continue;
        const at::Tensor& drawn = state.keep_masks[Ring::mask_index(step, qi, kj)];
        at::Tensor keep = drawn.defined() ? drawn : at::ones({chunk, chunk}, full.options());
        if (kind == CausalBlock::kDiagonal) keep = keep.logical_and(lower);
        const int64_t key_chunk = Ring::chunk(ring.size, ring.owner(step), kj);
        full.narrow(2, qi * chunk, chunk).narrow(3, key_chunk * chunk, chunk).copy_(keep);
      }
    }
  }
  return full;
}

// On a CPU without dropout each block runs PyTorch's fused flash-attention kernels (what
// scaled_dot_product_attention runs there for one device): a block's scores never exist whole,
// and its backward takes the final output and log-sum-exp, as FlashAttention's does.
bool fused_blocks(const at::Tensor& q, const RingState& state) { return q.device().is_cpu() && state.dropout_p == 0; }

// One block's output, normalised over the block alone, and its log-sum-exp (fp32). Under dropout
// the block's keep-mask is drawn into `keep` and applied to the normalised probabilities.
std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                CausalBlock kind, const RingState& state,
                                                const std::optional<at::Generator>& generator, at::Tensor& keep) {
  if (fused_blocks(q, state)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, kind == CausalBlock::kDiagonal,
                                                                      std::nullopt, state.scale);
    return {std::move(out), std::move(lse)};
  }
  const at::Tensor scores = block_scores(q, k, kind, state.scale);
  at::Tensor lse = scores.logsumexp(-1);
  at::Tensor probs = (scores - lse.unsqueeze(-1)).exp_();
  if (state.dropout_p > 0) {
    keep = at::empty_like(probs).bernoulli_(1 - state.dropout_p, generator).to(at::kBool);
    probs.mul_(keep).div_(1 - state.dropout_p);
  }
  return {at::matmul(probs, v), std::move(lse)};
}

// One block's share of dQ, dK and dV (added into the given views), FlashAttention's backward:
// P from the final lse, Z = P * keep / (1 - p), dV = Z^T dO, dS = P * (dZ * keep / (1 - p) - D)
// (`out`: the queries' final output, of which D = rowsum(dO * O); the fused kernel takes `out`,
// the matmuls `delta`).
void block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& grad_out,
                    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& delta, CausalBlock kind,
                    const RingState& state, const at::Tensor& keep, at::Tensor grad_q, at::Tensor grad_k,
                    at::Tensor grad_v) {
  if (fused_blocks(q, state)) {
    const auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, kind == CausalBlock::kDiagonal, std::nullopt, state.scale);
    grad_q.add_(dq);
    grad_k.add_(dk);
    grad_v.add_(dv);
    return;
  }
  const at::Tensor probs = (block_scores(q, k, kind, state.scale) - lse.unsqueeze(-1)).exp_();
  const double keep_scale = 1 / (1 - state.dropout_p);
  const at::Tensor dropped = keep.defined() ? probs * keep * keep_scale : probs;
  grad_v.add_(at::matmul(dropped.transpose(-2, -1), grad_out));
  at::Tensor grad_probs = at::matmul(grad_out, v.transpose(-2, -1));
  if (keep.defined()) grad_probs = grad_probs * keep * keep_scale;
  const at::Tensor grad_scores = probs * (grad_probs - delta.unsqueeze(-1));
  grad_q.add_(at::matmul(grad_scores, k), state.scale);
  grad_k.add_(at::matmul(grad_scores.transpose(-2, -1), q), state.scale);
}

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               ContextParallelGroup* group, double scale, double dropout_p,
                               std::optional<at::Generator> generator, bool want_keep_mask) {
    auto state = c10::make_intrusive<RingState>();
    state->group = group;
    state->scale = scale;
    state->dropout_p = dropout_p;
    const Ring ring{group->rank(), group->size()};
    state->keep_masks.resize(4 * ring.size);

    const at::Tensor q32 = q.to(at::kFloat);
    std::array<Partial, 2> partial;
    at::Tensor kv = at::stack({k, v});  // travels in the input dtype: half the bytes for bf16
    for (int step = 0; step < ring.size; ++step) {
      auto next = step + 1 < ring.size ? start_exchange(*group, kv) : nullptr;
      const at::Tensor kv32 = kv.to(at::kFloat);
      for (int qi = 0; qi < 2; ++qi) {
        for (int kj = 0; kj < 2; ++kj) {
          const CausalBlock kind = ring.block(step, qi, kj);
          if (kind == CausalBlock::kSkip) continue;
          at::Tensor& keep = state->keep_masks[Ring::mask_index(step, qi, kj)];
          const auto [block_out, block_lse] = block_forward(half_of(q32, qi), half_of(kv32[0], kj),
                                                            half_of(kv32[1], kj), kind, *state, generator, keep);
          partial[qi].merge(block_out, block_lse);
        }
      }
      if (next) kv = next->wait();
    }
    const at::Tensor out = at::cat({partial[0].out, partial[1].out}, 2).to(q.scalar_type());
    state->lse = at::cat({partial[0].lse, partial[1].lse}, 2);
    const at::Tensor keep_mask =
        want_keep_mask ? assemble_keep_mask(*state, ring, q) : at::empty({0}, q.options().dtype(at::kBool));
    ctx->save_for_backward({q, k, v, out});
    ctx->saved_data[kState] = c10::IValue::make_capsule(state);
    ctx->mark_non_differentiable({keep_mask});
    return {out, keep_mask};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const auto state = c10::static_intrusive_pointer_cast<RingState>(ctx->saved_data[kState].toCapsule());
    ContextParallelGroup& group = *state->group;
    const Ring ring{group.rank(), group.size()};
    // Every rank must take part in the ring even when its output had no gradient.
    const at::Tensor grad_out = grads[0].defined() ? grads[0].to(at::kFloat) : at::zeros_like(out, at::kFloat);
    const at::Tensor q32 = q.to(at::kFloat), out32 = out.to(at::kFloat);
    // D_i = sum_j P_ij dP_ij = dO_i . O_i, also under dropout (it scales P and dP alike); the fused
    // kernels compute it themselves from the output.
    const at::Tensor delta = fused_blocks(q32, *state) ? at::Tensor() : (grad_out * out32).sum(-1);
    at::Tensor grad_q = at::zeros_like(q32);

    at::Tensor kv = at::stack({k, v});
    std::unique_ptr<ContextParallelGroup::Exchange> incoming_grads;
    at::Tensor own_grad_kv;
    for (int step = 0; step < ring.size; ++step) {
      auto next = step + 1 < ring.size ? start_exchange(group, kv) : nullptr;
      const at::Tensor kv32 = kv.to(at::kFloat);
      at::Tensor grad_kv = at::zeros_like(kv32);
      for (int qi = 0; qi < 2; ++qi) {
        for (int kj = 0; kj < 2; ++kj) {
          const CausalBlock kind = ring.block(step, qi, kj);
          if (kind == CausalBlock::kSkip) continue;
          const at::Tensor& keep = state->keep_masks[Ring::mask_index(step, qi, kj)];
          block_backward(half_of(q32, qi), half_of(kv32[0], kj), half_of(kv32[1], kj), half_of(grad_out, qi),
                         half_of(out32, qi), rows_half_of(state->lse, qi),
                         delta.defined() ? rows_half_of(delta, qi) : delta, kind, *state, keep,
                         half_of(grad_q, qi), half_of(grad_kv[0], kj), half_of(grad_kv[1], kj));
        }
      }
      // The block's gradient from the ranks it visited before arrives while this step computes;
      // then it goes on with the block, and after the last step it reaches the block's owner.
      if (incoming_grads) grad_kv.add_(incoming_grads->wait());
      if (ring.size == 1) own_grad_kv = grad_kv;
      incoming_grads = start_exchange(group, grad_kv);
      if (next) kv = next->wait();
    }
    if (incoming_grads) own_grad_kv = incoming_grads->wait();
    return {grad_q.to(q.scalar_type()), own_grad_kv[0].to(k.scalar_type()), own_grad_kv[1].to(v.scalar_type()),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_ring_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, ContextParallelGroup& group,
                       double dropout_p) {
  if (q.dim() != 4) {
    throw std::invalid_argument("ring_attention: q has shape " + sizes_text(q.sizes()) +
                                ", expected [B, H, 2L, D] (this rank's zigzag shard)");
  }
  const auto check_agrees = [&q](const char* name, const at::Tensor& t) {
    if (t.sizes() != q.sizes() || t.scalar_type() != q.scalar_type() || t.device() != q.device()) {
      throw std::invalid_argument(std::string("ring_attention: ") + name + " is " + sizes_text(t.sizes()) + " " +
                                  c10::toString(t.scalar_type()) + " on " + t.device().str() + ", q is " +
                                  sizes_text(q.sizes()) + " " + c10::toString(q.scalar_type()) + " on " +
                                  q.device().str() + "; they must agree");
    }
  };
  check_agrees("k", k);
  check_agrees("v", v);
  if (!at::isFloatingType(q.scalar_type())) {
    throw std::invalid_argument(std::string("ring_attention: q is ") + c10::toString(q.scalar_type()) +
                                ", expected a floating-point dtype");
  }
  if (q.size(2) == 0 || q.size(2) % 2 != 0) {
    throw std::invalid_argument("ring_attention: q holds " + std::to_string(q.size(2)) +
                                " positions along dim 2; a zigzag shard holds two equal, non-empty chunks");
  }
  if (!(dropout_p >= 0 && dropout_p < 1)) {
    throw std::invalid_argument("ring_attention: dropout_p " + std::to_string(dropout_p) + " is not in [0, 1)");
  }
  check_rank(group.size(), group.rank(), "ring_attention");
}

}  // namespace

RingAttentionWithMask ring_attention_with_keep_mask(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    ContextParallelGroup& group, double scale, double dropout_p,
                                                    std::optional<at::Generator> generator) {
  check_ring_inputs(q, k, v, group, dropout_p);
  const variable_list outputs =
      RingAttentionFunction::apply(q, k, v, &group, scale, dropout_p, std::move(generator), true);
  return {outputs[0], outputs[1]};
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, ContextParallelGroup& group,
                          double scale, double dropout_p, std::optional<at::Generator> generator) {
  check_ring_inputs(q, k, v, group, dropout_p);
  return RingAttentionFunction::apply(q, k, v, &group, scale, dropout_p, std::move(generator), false)[0];
}

}  // namespace harness::model
