// The token cross entropy of the loss (SPEC §3) as one fused operation on the CPU.
#pragma once

#include <ATen/core/Tensor.h>

namespace harness::model {

// sum_r weights[r] * CE_r, CE_r = logsumexp(logits[r]) - logits[r, labels[r]], for logits [N, V],
// labels [N] (int64) and weights [N]; a label of -100 (torch's ignore_index) counts 0. The result
// and its gradient are those of (cross_entropy(logits, labels, reduction none) * weights).sum(),
// to rounding; on the CPU in fp32 one pass over the logits forward (a max and a sum of exps per
// row, kept in cache) and one backward (softmax minus the label, times the weight), instead of
// log-softmax's and the NLL's separate passes. Gradients flow to the logits alone, first order.
// A label outside [0, V) other than -100 throws c10::Error naming it.
at::Tensor weighted_token_cross_entropy_sum(const at::Tensor& logits, const at::Tensor& labels,
                                            const at::Tensor& weights);

}  // namespace harness::model
