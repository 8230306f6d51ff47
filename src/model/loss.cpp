// The weighted token cross entropy of SPEC §3 (see loss.h).
#include "harness/model/loss.h"

#include <torch/torch.h>

#include <sstream>
#include <stdexcept>

#include "harness/model/cross_entropy.h"
#include "harness/model/vocab_parallel.h"

namespace harness::model {
namespace {

std::string shape_of(const at::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes();
  return out.str();
}

void check_shapes(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& weights) {
  if (logits.dim() != 3) {
    throw std::invalid_argument("weighted_cross_entropy: logits must be [B, T, V], got " + shape_of(logits));
  }
  const int64_t B = logits.size(0), T = logits.size(1);
  if (labels.dim() != 2 || labels.size(0) != B || labels.size(1) != T) {
    throw std::invalid_argument("weighted_cross_entropy: labels must be [" + std::to_string(B) + ", " +
                                std::to_string(T) + "] like logits " + shape_of(logits) + ", got " +
                                shape_of(labels));
  }
  if (weights.sizes() != labels.sizes()) {
    throw std::invalid_argument("weighted_cross_entropy: label_token_weights must have the shape of labels " +
                                shape_of(labels) + ", got " + shape_of(weights));
  }
}

// The one definition of the loss: sum(CE * weights) / weight_sum, shapes checked; weight_sum
// undefined means the weights' own sum. With a group, `logits` is this rank's vocabulary slice.
at::Tensor weighted_loss(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& weights,
                         const at::Tensor& weight_sum, int64_t vocab_size, TensorParallelGroup* group) {
  check_shapes(logits, labels, weights);
  const at::Tensor float_weights = weights.to(logits.device(), torch::kFloat32);
  at::Tensor divisor;
  if (weight_sum.defined()) {
    if (weight_sum.numel() != 1) {
      throw std::invalid_argument("weighted_cross_entropy: weight_sum must be a scalar, got " + shape_of(weight_sum));
    }
    divisor = weight_sum.to(logits.device(), torch::kFloat32);
  } else {
    divisor = float_weights.sum();
    if (divisor.item<float>() == 0.0f) {
      throw std::invalid_argument("weighted_cross_entropy: label_token_weights " + shape_of(weights) +
                                  " sum to 0 (no target token to learn from)");
    }
  }
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  const at::Tensor rows = logits.reshape({B * T, V});
  const at::Tensor ids = labels.reshape({B * T}).to(logits.device(), torch::kInt64);
  const at::Tensor token_weights = float_weights.reshape({B * T});
  if (group == nullptr) {
    return weighted_token_cross_entropy_sum(rows.to(torch::kFloat32), ids, token_weights) / divisor;
  }
  return (vocab_parallel_cross_entropy(rows, ids, vocab_size, *group) * token_weights).sum() / divisor;
}

}  // namespace

at::Tensor weighted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& weights) {
  return weighted_loss(logits, labels, weights, at::Tensor(), 0, nullptr);
}

at::Tensor weighted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& weights, const at::Tensor& weight_sum) {
  if (!weight_sum.defined()) throw std::invalid_argument("weighted_cross_entropy: weight_sum is undefined");
  return weighted_loss(logits, labels, weights, weight_sum, 0, nullptr);
}

at::Tensor vocab_parallel_weighted_cross_entropy(const at::Tensor& logits_slice, const at::Tensor& labels,
                                                 const at::Tensor& weights, const at::Tensor& weight_sum,
                                                 int64_t vocab_size, TensorParallelGroup& group) {
  return weighted_loss(logits_slice, labels, weights, weight_sum, vocab_size, &group);
}

}  // namespace harness::model
