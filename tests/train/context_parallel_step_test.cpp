// The context-parallel batch shards: padding to a multiple of 2C that the loss ignores, the
// zigzag split of ids, labels and weights together, and the refusal of C below 1.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>

#include "harness/train/step/context_parallel_step.h"

namespace harness::train {
namespace {

TEST(ContextParallelStep, LengthIsTheNextMultipleOfTwoC) {
  EXPECT_EQ(context_parallel_length(40, 1), 40);
  EXPECT_EQ(context_parallel_length(39, 1), 40);
  EXPECT_EQ(context_parallel_length(40, 2), 40);
  EXPECT_EQ(context_parallel_length(38, 2), 40);
  EXPECT_EQ(context_parallel_length(127, 3), 132);
  EXPECT_THROW(context_parallel_length(40, 0), std::invalid_argument);
  // With sequence parallelism over T ranks: a multiple of 2C * T, or of T alone when C = 1.
  EXPECT_EQ(split_sequence_length(39, 1, 1), 39);
  EXPECT_EQ(split_sequence_length(39, 1, 2), 40);
  EXPECT_EQ(split_sequence_length(40, 1, 3), 42);
  EXPECT_EQ(split_sequence_length(40, 2, 2), 40);
  EXPECT_EQ(split_sequence_length(41, 2, 2), 48);
  EXPECT_EQ(split_sequence_length(38, 2, 1), 40);
  EXPECT_THROW(split_sequence_length(40, 0, 2), std::invalid_argument);
  EXPECT_THROW(split_sequence_length(40, 2, 0), std::invalid_argument);
}

TEST(ContextParallelStep, ShardsPadWithPositionsTheLossIgnoresAndSplitTheZigzagWay) {
  // One row of 6 tokens over C = 2: padded to 8, rank 0 holds positions 0 1 6 7, rank 1 2 3 4 5.
  data::Batch batch;
  batch.input_ids = torch::arange(1, 7, torch::kLong).unsqueeze(0);
  batch.labels = torch::arange(2, 8, torch::kLong).unsqueeze(0);  // shifted by collate, whole
  batch.label_token_weights = torch::tensor({0.f, 0.f, 1.f, 1.f, 1.f, 1.f}).unsqueeze(0);
  batch.examples.resize(1);
  const data::Batch zero = context_shard(batch, 2, 0), one = context_shard(batch, 2, 1);
  EXPECT_TRUE(torch::equal(zero.input_ids, torch::tensor({1L, 2L, 0L, 0L}).unsqueeze(0)));
  EXPECT_TRUE(torch::equal(zero.labels, torch::tensor({2L, 3L, 0L, 0L}).unsqueeze(0)));
  EXPECT_TRUE(torch::equal(zero.label_token_weights, torch::tensor({0.f, 0.f, 0.f, 0.f}).unsqueeze(0)));
  EXPECT_TRUE(torch::equal(one.input_ids, torch::tensor({3L, 4L, 5L, 6L}).unsqueeze(0)));
  EXPECT_TRUE(torch::equal(one.labels, torch::tensor({4L, 5L, 6L, 7L}).unsqueeze(0)));
  EXPECT_EQ(one.label_token_weights.sum().item<float>(), batch.label_token_weights.sum().item<float>());
  EXPECT_EQ(one.examples.size(), 1u);
  // C = 1 with sequence parallelism over 4 ranks: the batch padded to 8, not split.
  const data::Batch padded = context_shard(batch, 1, 0, 4);
  EXPECT_TRUE(torch::equal(padded.input_ids, torch::tensor({1L, 2L, 3L, 4L, 5L, 6L, 0L, 0L}).unsqueeze(0)));
  EXPECT_EQ(padded.label_token_weights.sum().item<float>(), batch.label_token_weights.sum().item<float>());
  // C = 2 with T = 2: padded to 8 and split, 4 a context rank.
  EXPECT_EQ(context_shard(batch, 2, 1, 2).input_ids.size(1), 4);
  // C = 1: the batch itself.
  const data::Batch whole = context_shard(batch, 1, 0);
  EXPECT_TRUE(torch::equal(whole.input_ids, batch.input_ids));
  EXPECT_TRUE(torch::equal(whole.label_token_weights, batch.label_token_weights));
}

}  // namespace
}  // namespace harness::train
