// The tied head's arithmetic when the vocabulary is split over a tensor-parallel group (Megatron's
// vocabulary-parallel cross entropy): each rank holds its slice of the logits, [N, V_t] for the
// ids vocabulary_range(V, t, T) gives it, and no rank ever holds all V of them. The loss and the
// greedy pick reduce a few numbers per row over the group instead.
#pragma once

#include <ATen/core/Tensor.h>

#include "harness/model/tensor_parallel.h"

namespace harness::model {

// Per-row cross entropy from this rank's slice `logits_slice` [N, V_t] of the logits over
// `vocab_size` ids, labels [N] (int64): logsumexp(row) - row[label], a float32 [N] equal on every
// rank of `group`. A max, a sum of exponentials and the label's logit are each all-reduced over
// the group. A label of -100 (torch's ignore_index) gives 0 and no gradient; any other label
// outside [0, vocab_size) throws (checked where the labels are on the CPU). Backward, collective-
// free: this rank's slice of softmax(row) - one_hot(label), times the row's upstream gradient,
// which must be the same on every rank (a replicated loss). Every rank calls it in the same order.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_slice, const at::Tensor& labels, int64_t vocab_size,
                                        TensorParallelGroup& group);

// The arg-max of each row over the whole vocabulary from the slices [N, V_t]: [N] int64 global
// ids, equal on every rank. Only ids below `limit` compete (a tokenizer smaller than the head);
// ties go to the lowest id, as argmax on the unsplit logits does. One all-gather.
at::Tensor vocab_parallel_argmax(const at::Tensor& logits_slice, int64_t vocab_size, int64_t limit,
                                 TensorParallelGroup& group);

// Megatron's VocabParallelEmbedding: the rows of `weight_slice` [V_t, C] (this rank's ids of a
// `vocab_size` vocabulary) for the ids [...] that fall in this rank's range, zero for the others,
// summed over the group (its reduce_from_region): [..., C], the whole embedding on every rank.
// The slice's gradient is its own rows' alone. `sequence_dim` >= 0 (sequence parallelism): the
// sum is reduce-scattered along that dimension instead, each rank keeping its part of it.
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight_slice, int64_t vocab_size,
                                    TensorParallelGroup& group, int64_t sequence_dim = -1);

// Every rank's slice [..., V_t] joined into the whole logits [..., V] on every rank (forward(),
// for callers that want the logits themselves; the loss and the greedy pick never build them).
// Backward: this rank's slice of the upstream gradient, which must be the same on every rank.
at::Tensor vocab_parallel_gather(const at::Tensor& logits_slice, int64_t vocab_size, TensorParallelGroup& group);

}  // namespace harness::model
