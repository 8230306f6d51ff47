// The context-parallel forward-backward and the batch shards it runs on (see context_parallel_step.h).
#include "harness/train/step/context_parallel_step.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "harness/model/context_parallel.h"

namespace harness::train {

int64_t context_parallel_length(int64_t sequence_length, int context_parallel_size) {
  if (context_parallel_size < 1) {
    throw std::invalid_argument("--context_parallel_size must be at least 1, got " +
                                std::to_string(context_parallel_size));
  }
  const int64_t chunks = 2 * static_cast<int64_t>(context_parallel_size);
  return (sequence_length + chunks - 1) / chunks * chunks;
}

int64_t split_sequence_length(int64_t sequence_length, int context_parallel_size, int sequence_parallel_size) {
  if (sequence_parallel_size < 1) {
    throw std::invalid_argument("sequence parallelism over " + std::to_string(sequence_parallel_size) +
                                " ranks: expected at least 1");
  }
  // 2C zigzag chunks (context_parallel_length throws, naming the flag, for C < 1).
  const int64_t unit = context_parallel_size == 1 ? 1 : context_parallel_length(1, context_parallel_size);
  const int64_t chunks = unit * sequence_parallel_size;
  return (sequence_length + chunks - 1) / chunks * chunks;
}

data::Batch context_shard(const data::Batch& batch, int context_parallel_size, int rank, int sequence_parallel_size) {
  const int64_t length = batch.input_ids.size(1);
  const int64_t padding =
      (sequence_parallel_size > 1 ? split_sequence_length(length, context_parallel_size, sequence_parallel_size)
                                  : context_parallel_length(length, context_parallel_size)) -
      length;
  auto shard = [&](const at::Tensor& x) {
    const at::Tensor padded = padding == 0 ? x : torch::constant_pad_nd(x, {0, padding}, 0);
    return context_parallel_size == 1 ? padded : model::zigzag_shard(padded, /*dim=*/1, context_parallel_size, rank);
  };
  data::Batch out;
  out.input_ids = shard(batch.input_ids);
  out.labels = shard(batch.labels);
  out.label_token_weights = shard(batch.label_token_weights);
  out.examples = batch.examples;
  return out;
}

namespace {

class ContextParallelForwardBackward final : public WrappedForwardBackward {
 public:
  ContextParallelForwardBackward(std::unique_ptr<ForwardBackward> inner, int context_parallel_size, int rank,
                                 int sequence_parallel_size)
      : WrappedForwardBackward(std::move(inner), "context_parallel"),
        size_(context_parallel_size),
        rank_(rank),
        sequence_(sequence_parallel_size) {}

  at::Tensor run(const data::Batch& batch, const at::Tensor& weight_sum, int64_t k,
                 model::Precision precision) override {
    // Every context rank holds the whole batch, so the replica's label weight needs no collective.
    at::Tensor whole = weight_sum;
    if (!whole.defined()) {
      whole = batch.label_token_weights.to(loss_device(), torch::kFloat32).sum();
      if (whole.item<float>() == 0.0f) {
        throw std::invalid_argument("the batch's label_token_weights sum to 0 (no target token to learn from)");
      }
    }
    const at::Tensor loss = inner().run(context_shard(batch, size_, rank_, sequence_), whole / size_, k, precision);
    return loss.defined() ? loss / size_ : loss;
  }

 private:
  int size_;
  int rank_;
  int sequence_;
};

}  // namespace

std::unique_ptr<ForwardBackward> context_parallel(std::unique_ptr<ForwardBackward> inner, int context_parallel_size,
                                                  int rank, int sequence_parallel_size) {
  return std::make_unique<ContextParallelForwardBackward>(std::move(inner), context_parallel_size, rank,
                                                          sequence_parallel_size);
}

}  // namespace harness::train
