// weighted_token_cross_entropy_sum (see cross_entropy.h): a custom autograd function around the
// row loops of cross_entropy_kernel.cpp.
#include "harness/model/cross_entropy.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <algorithm>

#include "cross_entropy_kernel.h"

namespace harness::model {
namespace {

constexpr int64_t kIgnoreIndex = -100;
constexpr const char* kRecordName = "harness::weighted_token_cross_entropy";

// Rows per parallel task: about 32k logits each.
int64_t row_grain(int64_t V) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1)); }

// Whether the gradient may take the saved logits' place: nothing but this node holds them (its
// saved copy and the one unpacked for this backward; a view, such as the head's output reshaped to
// rows, with a base that only the view holds), and the graph goes with this backward, so that
// nobody can read them after. Then the head's gradient needs no buffer of its own, [N, V]: the
// largest of a language model's step, held by a zero-bubble stage until its W pass.
bool only_this_node_holds(const at::Tensor& x) {
  if (torch::autograd::get_current_graph_task_keep_graph() || x.use_count() > 2) return false;
  const size_t owners = x.storage().use_count();
  if (!x.is_view()) return owners == 1;
  return owners == 2 && x._base().use_count() == 1;
}

class FusedWeightedCrossEntropy : public torch::autograd::Function<FusedWeightedCrossEntropy> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& labels, const at::Tensor& weights) {
    const at::Tensor x = logits.contiguous();
    const int64_t N = x.size(0), V = x.size(1);
    at::Tensor lse = at::empty({N}, x.options());
    const float* rows = x.data_ptr<float>();
    float* out = lse.data_ptr<float>();
    at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
      detail::rows_logsumexp(rows + begin * V, end - begin, V, out + begin);
    });
    const at::Tensor ignored = labels == kIgnoreIndex;
    const at::Tensor target = x.gather(1, labels.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1);
    const at::Tensor per_token = (lse - target).masked_fill_(ignored, 0.0);
    ctx->save_for_backward({x, lse, labels, weights.masked_fill(ignored, 0.0)});
    return (per_token * weights).sum();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& lse = saved[1];
    const at::Tensor labels = saved[2].contiguous();
    const at::Tensor scale = (saved[3] * grads[0].to(at::kFloat)).contiguous();  // weight x upstream gradient
    const int64_t N = x.size(0), V = x.size(1);
    // In place is safe row by row: each logit is read before its gradient is written over it.
    at::Tensor d = only_this_node_holds(x) ? x : at::empty_like(x);
    const float* rows = x.data_ptr<float>();
    const float* shifts = lse.data_ptr<float>();
    const int64_t* targets = labels.data_ptr<int64_t>();
    const float* scales = scale.data_ptr<float>();
    float* out = d.data_ptr<float>();
    at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
      detail::rows_cross_entropy_backward(rows + begin * V, shifts + begin, targets + begin, scales + begin,
                                          end - begin, V, out + begin * V);
    });
    return {d, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor weighted_token_cross_entropy_sum(const at::Tensor& logits, const at::Tensor& labels,
                                            const at::Tensor& weights) {
  TORCH_CHECK(logits.dim() == 2 && labels.dim() == 1 && weights.dim() == 1 && labels.size(0) == logits.size(0) &&
                  weights.size(0) == logits.size(0),
              "weighted_token_cross_entropy_sum: logits [N, V], labels [N] and weights [N] expected, got ",
              logits.sizes(), ", ", labels.sizes(), " and ", weights.sizes());
  const bool fused = logits.is_cpu() && logits.scalar_type() == at::kFloat && labels.scalar_type() == at::kLong &&
                     weights.scalar_type() == at::kFloat && labels.is_cpu() && weights.is_cpu() && logits.size(1) > 0;
  if (!fused) {
    const at::Tensor per_token = torch::nn::functional::cross_entropy(
        logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    return (per_token * weights).sum();
  }
  if (labels.numel() > 0) {
    const at::Tensor bad = ((labels < 0) | (labels >= logits.size(1))) & (labels != kIgnoreIndex);
    if (bad.any().item<bool>()) {
      const int64_t at_row = bad.nonzero()[0][0].item<int64_t>();
      TORCH_CHECK(false, "weighted_token_cross_entropy_sum: label ", labels[at_row].item<int64_t>(), " of token ",
                  at_row, " is outside the vocabulary [0, ", logits.size(1), ")");
    }
  }
  // Recorded under its own name (profiles, and the test of which ops run in which dtype).
  at::RecordFunction record(at::RecordScope::FUNCTION);
  if (record.isActive()) record.before(kRecordName, c10::ArrayRef<const c10::IValue>{});
  at::Tensor loss = FusedWeightedCrossEntropy::apply(logits, labels, weights.detach());
  if (record.isActive() && record.needsOutputs()) record.setOutputs(std::vector<c10::IValue>{loss});
  return loss;
}

}  // namespace harness::model
