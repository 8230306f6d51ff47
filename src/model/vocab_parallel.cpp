// Cross entropy and arg-max over a vocabulary split across a tensor-parallel group (see
// vocab_parallel.h).
#include "harness/model/vocab_parallel.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "cross_entropy_kernel.h"
#include "shape_text.h"

namespace harness::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ReduceOp = TensorParallelGroup::ReduceOp;

constexpr int64_t kIgnoreIndex = -100;

// Rows per parallel task: about 32k logits each (as the unsplit loss's).
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

VocabularyRange checked_slice(const char* what, const at::Tensor& logits_slice, int64_t vocab_size,
                              const TensorParallelGroup& group) {
  const VocabularyRange range = vocabulary_range(vocab_size, group.rank(), group.size());
  if (logits_slice.dim() != 2 || logits_slice.size(1) != range.size()) {
    throw std::invalid_argument(std::string(what) + ": logits slice must be [N, " + std::to_string(range.size()) +
                                "] (ids [" + std::to_string(range.start) + ", " + std::to_string(range.end) +
                                ") of " + std::to_string(vocab_size) + " on rank " + std::to_string(group.rank()) +
                                " of " + std::to_string(group.size()) + "), got " + shape_str(logits_slice.sizes()));
  }
  return range;
}

// The per-row loss; the group travels as a pointer (its owner, the model, outlives the graph).
// On the CPU in fp32 the exponentials are those of the unsplit loss's row loops
// (cross_entropy_kernel.h), summed in double as there, so a split head's loss and gradient are the
// unsplit one's (unless a row's logsumexp lies within a rounding of a float boundary); elsewhere
// torch's own exponentials. The backward recomputes the softmax slice from
// the logits and the whole rows' logsumexp (nothing beyond the logits is kept).
class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_slice, const at::Tensor& labels,
                            int64_t start, TensorParallelGroup* group) {
    const at::Tensor x = logits_slice.to(torch::kFloat32).contiguous();
    const int64_t n = x.size(0), width = x.size(1);
    const at::Tensor max = group->all_reduce(std::get<0>(x.max(1)), ReduceOp::kMax);
    // The sums of exponentials in double (as the unsplit loss's), added over the group, so that
    // the whole rows' logsumexp is the unsplit one's to float's precision.
    at::Tensor sums;
    if (x.is_cpu()) {
      sums = at::empty({n}, x.options().dtype(torch::kFloat64));
      const float* rows = x.data_ptr<float>();
      const float* shifts = max.data_ptr<float>();
      double* out = sums.data_ptr<double>();
      at::parallel_for(0, n, row_grain(width), [&](int64_t begin, int64_t end) {
        detail::rows_sum_exp(rows + begin * width, end - begin, width, shifts + begin, out + begin);
      });
    } else {
      sums = (x - max.unsqueeze(1)).exp().sum(1, /*keepdim=*/false, torch::kFloat64);
    }
    const at::Tensor lse =
        (max.to(torch::kFloat64) + group->all_reduce(sums, ReduceOp::kSum).log()).to(torch::kFloat32);
    // Labels in this rank's range as local columns; -1 (which the backward skips) elsewhere.
    const at::Tensor here = labels.ge(start).logical_and_(labels.lt(start + width));
    const at::Tensor local_label = (labels - start).masked_fill_(here.logical_not(), -1);
    const at::Tensor label_logit_here =
        n == 0 ? x.new_zeros({0})
               : x.gather(1, local_label.clamp_min(0).unsqueeze(1)).squeeze(1).masked_fill_(here.logical_not(), 0.0);
    const at::Tensor label_logit = group->all_reduce(label_logit_here, ReduceOp::kSum);
    const at::Tensor ignored = labels.eq(kIgnoreIndex);
    ctx->save_for_backward({x, lse, local_label, ignored});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits_slice.scalar_type());
    return (lse - label_logit).masked_fill_(ignored, 0.0);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& lse = saved[1];
    const at::Tensor local_label = saved[2].contiguous();
    const at::Tensor scale = grads[0].to(torch::kFloat32).masked_fill(saved[3], 0.0).contiguous();
    const int64_t n = x.size(0), width = x.size(1);
    at::Tensor grad;
    if (x.is_cpu()) {
      grad = at::empty_like(x);
      const float* rows = x.data_ptr<float>();
      const float* shifts = lse.data_ptr<float>();
      const int64_t* targets = local_label.data_ptr<int64_t>();
      const float* scales = scale.data_ptr<float>();
      float* out = grad.data_ptr<float>();
      at::parallel_for(0, n, row_grain(width), [&](int64_t begin, int64_t end) {
        detail::rows_cross_entropy_backward(rows + begin * width, shifts + begin, targets + begin, scales + begin,
                                            end - begin, width, out + begin * width);
      });
    } else {
      grad = (x - lse.unsqueeze(1)).exp_().mul_(scale.unsqueeze(1));
      if (n > 0) {
        const at::Tensor here = local_label.ge(0);
        grad.scatter_add_(1, local_label.clamp_min(0).unsqueeze(1), (-scale * here.to(torch::kFloat32)).unsqueeze(1));
      }
    }
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The join of the slices: padded to the widest slice for the all-gather, then cut to each
// rank's width; backward, this rank's columns.
class VocabParallelGather : public torch::autograd::Function<VocabParallelGather> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_slice, int64_t vocab_size,
                            TensorParallelGroup* group) {
    const int T = group->size();
    const VocabularyRange here = vocabulary_range(vocab_size, group->rank(), T);
    ctx->saved_data["start"] = here.start;
    ctx->saved_data["width"] = here.size();
    const int64_t widest = vocabulary_range(vocab_size, 0, T).size();
    at::Tensor padded = logits_slice;
    if (here.size() < widest) {
      std::vector<int64_t> pad_shape = logits_slice.sizes().vec();
      pad_shape.back() = widest - here.size();
      padded = torch::cat({logits_slice, logits_slice.new_zeros(pad_shape)}, -1);
    }
    std::vector<at::Tensor> parts = group->all_gather(padded.contiguous());
    for (int t = 0; t < T; ++t) {
      at::Tensor& part = parts[static_cast<size_t>(t)];
      part = part.narrow(-1, 0, vocabulary_range(vocab_size, t, T).size());
    }
    return torch::cat(parts, -1);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t start = ctx->saved_data["start"].toInt(), width = ctx->saved_data["width"].toInt();
    return {grads[0].narrow(-1, start, width).contiguous(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight_slice, int64_t vocab_size,
                                    TensorParallelGroup& group, int64_t sequence_dim) {
  const VocabularyRange range = vocabulary_range(vocab_size, group.rank(), group.size());
  if (weight_slice.dim() != 2 || weight_slice.size(0) != range.size()) {
    throw std::invalid_argument("vocab_parallel_embedding: weight slice must be [" + std::to_string(range.size()) +
                                ", C] (ids [" + std::to_string(range.start) + ", " + std::to_string(range.end) +
                                ") of " + std::to_string(vocab_size) + " on rank " + std::to_string(group.rank()) +
                                "), got " + shape_str(weight_slice.sizes()));
  }
  const at::Tensor elsewhere = ids.lt(range.start).logical_or_(ids.ge(range.end));
  const at::Tensor local_ids = (ids - range.start).masked_fill_(elsewhere, 0);
  const at::Tensor rows = torch::embedding(weight_slice, local_ids).masked_fill(elsewhere.unsqueeze(-1), 0.0);
  return sequence_dim >= 0 ? group.reduce_scatter_sequence(rows, sequence_dim) : group.reduce_from_region(rows);
}

at::Tensor vocab_parallel_gather(const at::Tensor& logits_slice, int64_t vocab_size, TensorParallelGroup& group) {
  const VocabularyRange range = vocabulary_range(vocab_size, group.rank(), group.size());
  if (logits_slice.dim() < 1 || logits_slice.size(-1) != range.size()) {
    throw std::invalid_argument("vocab_parallel_gather: logits slice must be [..., " + std::to_string(range.size()) +
                                "] on rank " + std::to_string(group.rank()) + ", got " +
                                shape_str(logits_slice.sizes()));
  }
  return VocabParallelGather::apply(logits_slice, vocab_size, &group);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_slice, const at::Tensor& labels, int64_t vocab_size,
                                        TensorParallelGroup& group) {
  const VocabularyRange range = checked_slice("vocab_parallel_cross_entropy", logits_slice, vocab_size, group);
  if (labels.dim() != 1 || labels.size(0) != logits_slice.size(0)) {
    throw std::invalid_argument("vocab_parallel_cross_entropy: labels must be [" +
                                std::to_string(logits_slice.size(0)) + "] like the logits slice " +
                                shape_str(logits_slice.sizes()) + ", got " + shape_str(labels.sizes()));
  }
  const at::Tensor ids = labels.to(logits_slice.device(), torch::kInt64);
  if (ids.is_cpu() && ids.numel() > 0) {  // on a GPU this check would cost a synchronisation
    const at::Tensor bad = ids.ne(kIgnoreIndex).logical_and_(ids.lt(0).logical_or_(ids.ge(vocab_size)));
    if (bad.any().item<bool>()) {
      const int64_t row = bad.nonzero()[0][0].item<int64_t>();
      throw std::invalid_argument("vocab_parallel_cross_entropy: label " + std::to_string(ids[row].item<int64_t>()) +
                                  " (row " + std::to_string(row) + ") is outside the vocabulary [0, " +
                                  std::to_string(vocab_size) + ") and is not the ignore index -100");
    }
  }
  return VocabParallelCrossEntropy::apply(logits_slice, ids, range.start, &group);
}

at::Tensor vocab_parallel_argmax(const at::Tensor& logits_slice, int64_t vocab_size, int64_t limit,
                                 TensorParallelGroup& group) {
  const VocabularyRange range = checked_slice("vocab_parallel_argmax", logits_slice, vocab_size, group);
  if (limit < 1 || limit > vocab_size) {
    throw std::invalid_argument("vocab_parallel_argmax: limit " + std::to_string(limit) + " is outside [1, " +
                                std::to_string(vocab_size) + "]");
  }
  torch::NoGradGuard no_grad;
  const int64_t n = logits_slice.size(0);
  const int64_t competing = std::clamp<int64_t>(limit - range.start, 0, range.size());
  const auto doubles = logits_slice.options().dtype(torch::kFloat64);
  // (value, global id) of this rank's best per row; a rank with no competing id offers -inf at
  // an id past the vocabulary, which any real id beats.
  at::Tensor best = torch::empty({2, n}, doubles);
  if (competing > 0) {
    const auto [value, index] = logits_slice.detach().narrow(1, 0, competing).max(1);
    best[0].copy_(value);
    best[1].copy_(index + range.start);
  } else {
    best[0].fill_(-std::numeric_limits<double>::infinity());
    best[1].fill_(static_cast<double>(vocab_size));
  }
  const at::Tensor all = torch::stack(group.all_gather(best));  // [T, 2, N]
  const at::Tensor values = all.select(1, 0), ids = all.select(1, 1);
  const at::Tensor top = std::get<0>(values.max(0));
  const at::Tensor tied = ids.masked_fill(values.ne(top.unsqueeze(0)), std::numeric_limits<double>::infinity());
  return std::get<0>(tied.min(0)).to(torch::kInt64);
}

}  // namespace harness::model
