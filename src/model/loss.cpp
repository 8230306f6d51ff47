// The weighted token cross entropy of SPEC §3 (see loss.h).
#include "harness/model/loss.h"

#include <torch/torch.h>

#include <sstream>
#include <stdexcept>

#include "harness/model/cross_entropy.h"

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

// sum(CE * weights) / weight_sum, shapes checked.
at::Tensor weighted_sum_over(const at::Tensor& logits, const at::Tensor& labels,
                             const at::Tensor& float_weights, const at::Tensor& weight_sum) {
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  return weighted_token_cross_entropy_sum(logits.reshape({B * T, V}).to(torch::kFloat32),
                                                labels.reshape({B * T}).to(logits.device(), torch::kInt64),
                                                float_weights.reshape({B * T})) /
         weight_sum;
}

}  // namespace

at::Tensor weighted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& weights) {
  check_shapes(logits, labels, weights);
  const at::Tensor float_weights = weights.to(logits.device(), torch::kFloat32);
  const at::Tensor weight_sum = float_weights.sum();
  if (weight_sum.item<float>() == 0.0f) {
    throw std::invalid_argument("weighted_cross_entropy: label_token_weights " + shape_of(weights) +
                                " sum to 0 (no target token to learn from)");
  }
  return weighted_sum_over(logits, labels, float_weights, weight_sum);
}

at::Tensor weighted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& weights, const at::Tensor& weight_sum) {
  check_shapes(logits, labels, weights);
  if (weight_sum.numel() != 1) {
    throw std::invalid_argument("weighted_cross_entropy: weight_sum must be a scalar, got " +
                                shape_of(weight_sum));
  }
  return weighted_sum_over(logits, labels, weights.to(logits.device(), torch::kFloat32),
                           weight_sum.to(logits.device(), torch::kFloat32));
}

}  // namespace harness::model
