// The combined label weight of an accumulated step (see loss.h).
#include "harness/train/loss.h"

#include <torch/torch.h>

#include <stdexcept>

namespace harness::train {

at::Tensor combined_label_weight(const std::vector<data::Batch>& batches, const c10::Device& device) {
  if (batches.empty()) throw std::invalid_argument("a training step needs at least one batch");
  at::Tensor sum = batches[0].label_token_weights.to(device, torch::kFloat32).sum();
  for (size_t k = 1; k < batches.size(); ++k) {
    sum = sum + batches[k].label_token_weights.to(device, torch::kFloat32).sum();
  }
  if (sum.item<float>() == 0.0f) {
    throw std::invalid_argument("the batch's label_token_weights sum to 0 (no target token to learn from)");
  }
  return sum;
}

}  // namespace harness::train
