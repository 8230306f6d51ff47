// The training loss of SPEC §3, GPT-2's own: token cross entropy weighted by label_token_weights.
#pragma once

#include <ATen/core/Tensor.h>

#include "harness/model/tensor_parallel.h"

namespace harness::model {

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

// The same loss when the tied head is split over the vocabulary of `group` (vocab_parallel.h):
// from this rank's slice of the logits [B, T, V_t] of a `vocab_size` vocabulary, the value (and,
// for the slice, the gradient) the two above give on the whole logits, on every rank. Labels of
// -100 or of weight 0 count nothing. weight_sum undefined: the weights' own sum (which must not
// be 0), as above. Collective over the group.
at::Tensor vocab_parallel_weighted_cross_entropy(const at::Tensor& logits_slice, const at::Tensor& labels,
                                                 const at::Tensor& weights, const at::Tensor& weight_sum,
                                                 int64_t vocab_size, TensorParallelGroup& group);

}  // namespace harness::model
