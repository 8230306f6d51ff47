// The training loss of SPEC §3: token cross entropy weighted by label_token_weights.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

#include "harness/data/collate.h"

namespace harness::train {

// sum(CE(logits[b,t], labels[b,t]) * weights[b,t]) / sum(weights), a float32 scalar.
// logits [B, T, V], labels [B, T] int64, weights [B, T]. Throws when shapes disagree or the
// weights sum to zero.
at::Tensor weighted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& weights);

// The same sum over a part of a batch divided by the whole batch's `weight_sum` (a scalar), so
// that the parts' losses, and their gradients, add up to the whole batch's (pipeline
// micro-batches). Same shape checks; weight_sum must be positive.
at::Tensor weighted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& weights, const at::Tensor& weight_sum);

// The label weight of all `batches` together (the weight_sum above for batches accumulated into
// one optimizer step), a float32 scalar on `device`. Throws std::invalid_argument when there is no
// batch or the weights sum to zero.
at::Tensor combined_label_weight(const std::vector<data::Batch>& batches, const c10::Device& device);

}  // namespace harness::train
