// Context parallelism's part of a training step: each rank of a context group trains on its
// zigzag shard of every sequence of its replica's batches, on a model given that group
// (GPT2LMHeadModelImpl::set_context_parallel), so that the C ranks together compute one device's
// loss and gradient.
#pragma once

#include <cstdint>
#include <memory>

#include "harness/data/collate.h"
#include "harness/train/step/forward_backward.h"

namespace harness::train {

// The length a sequence of `sequence_length` positions is padded to for C context ranks: the
// smallest multiple of 2C at least as long (zigzag chunks are 2C equal parts).
int64_t context_parallel_length(int64_t sequence_length, int context_parallel_size);

// The length a sequence is padded to before it is split over C context ranks and, with sequence
// parallelism, each shard over the T ranks of a tensor-parallel group (sequence_parallel_size T;
// 1 without): the smallest multiple of 2C * T at least as long, or of T alone when C = 1.
int64_t split_sequence_length(int64_t sequence_length, int context_parallel_size, int sequence_parallel_size);

// Context rank `rank`'s part of `batch`: input ids, labels and label weights padded at the end
// to split_sequence_length (id 0, label 0, weight 0: positions the loss ignores, and which
// causal attention never lets an earlier position see), then each one's zigzag_shard along the
// sequence (C > 1). The labels are the batch's own, shifted on whole sequences by collate before
// any split. The examples are kept.
data::Batch context_shard(const data::Batch& batch, int context_parallel_size, int rank,
                          int sequence_parallel_size = 1);

// `inner` (the whole model's forward-backward, or ZeRO-3's) run on this rank's shard of each
// whole batch it is given. The loss is divided by the whole batches' label weight over C: the
// gradients are averaged over the data x context ranks while the C ranks' gradients sum to their
// replica's, so each rank's counts C times (as Megatron scales its loss by the context size); the
// loss returned is the replica's. Evaluation and generation are inner's. sequence_parallel_size
// T > 1: each shard is padded for sequence parallelism too (C = 1: the padding alone).
std::unique_ptr<ForwardBackward> context_parallel(std::unique_ptr<ForwardBackward> inner, int context_parallel_size,
                                                  int rank, int sequence_parallel_size = 1);

}  // namespace harness::train
