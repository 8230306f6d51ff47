// The vocabulary split of the tied head: its arithmetic (pure), and the vocabulary-parallel loss
// and arg-max across real processes (Gloo on CPU; vocab_parallel_worker_test.cpp is the worker).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <stdexcept>

#include "harness/model/config.h"
#include "harness/model/tensor_parallel.h"
#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

using model::ShardSpec;
using model::vocabulary_range;
using Ranges = std::vector<std::pair<int64_t, int64_t>>;

TEST(VocabularySplit, BalancedRangesCoverTheVocabularyWithAtMostOneRowOfDifference) {
  EXPECT_EQ(vocabulary_range(50257, 0, 2).start, 0);
  EXPECT_EQ(vocabulary_range(50257, 0, 2).end, 25129);
  EXPECT_EQ(vocabulary_range(50257, 1, 2).start, 25129);
  EXPECT_EQ(vocabulary_range(50257, 1, 2).end, 50257);
  // 1417 over 3: 473, 472, 472.
  EXPECT_EQ(vocabulary_range(1417, 0, 3).size(), 473);
  EXPECT_EQ(vocabulary_range(1417, 1, 3).start, 473);
  EXPECT_EQ(vocabulary_range(1417, 2, 3).start, 945);
  for (const int64_t V : {int64_t{3}, int64_t{7}, int64_t{61}, int64_t{1417}, int64_t{50257}}) {
    for (int T = 1; T <= 8 && T <= V; ++T) {
      int64_t next = 0;
      for (int t = 0; t < T; ++t) {
        const model::VocabularyRange range = vocabulary_range(V, t, T);
        EXPECT_EQ(range.start, next) << "V=" << V << " T=" << T << " t=" << t;
        EXPECT_GE(range.size(), V / T);
        EXPECT_LE(range.size(), V / T + 1);
        next = range.end;
      }
      EXPECT_EQ(next, V) << "V=" << V << " T=" << T;
    }
  }
  EXPECT_THROW(vocabulary_range(2, 0, 3), std::invalid_argument);
  EXPECT_THROW(vocabulary_range(10, 2, 2), std::invalid_argument);
}

TEST(VocabularySplit, BalancedRowShardsSplitAndJoinUnevenVocabularies) {
  const ShardSpec spec{ShardSpec::Kind::kBalancedRows, 1};
  EXPECT_EQ(spec.split_dim(2), 0);
  EXPECT_EQ(model::shard_ranges(1417, spec, 2, 3), (Ranges{{945, 472}}));
  const at::Tensor full = torch::arange(7 * 4).reshape({7, 4});
  for (int T = 1; T <= 3; ++T) {
    std::vector<at::Tensor> shards;
    for (int t = 0; t < T; ++t) shards.push_back(model::shard_tensor(full, spec, t, T));
    EXPECT_TRUE(torch::equal(model::unshard_tensor(shards, spec), full)) << "T=" << T;
  }
  EXPECT_TRUE(torch::equal(model::shard_tensor(full, spec, 1, 3), full.narrow(0, 3, 2)));
  EXPECT_THROW(model::shard_tensor(full, spec, 0, 8), std::invalid_argument);
  // Shards of another split, or of other row widths, are refused with their shapes.
  try {
    model::unshard_tensor({full.narrow(0, 0, 2), full.narrow(0, 2, 5)}, spec);
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 4]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model::unshard_tensor({full.narrow(0, 0, 4), full.narrow(0, 4, 3).narrow(1, 0, 2)}, spec),
               std::invalid_argument);
}

TEST(VocabularySplit, ATensorParallelModelNeedsAtLeastOneIdPerRank) {
  model::GPT2Config config = testing::tiny_config();
  config.vocab_size = 3;
  EXPECT_NO_THROW(model::validate_tensor_parallel(config, 2));
  EXPECT_THROW(model::validate_tensor_parallel(config, 4), std::invalid_argument);
}

void expect_workers_pass(const testing::CapturedLaunch& run) {
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

testing::CapturedLaunch launch_vocab_scenario(const std::string& scenario, int world_size) {
  return testing::launch_test_workers("tensor_parallel_tests", "VocabParallelWorker.Run", scenario, world_size);
}

// Loss, gradient and arg-max from the slices against torch's on the whole logits (V = 37 and
// 1417, which neither 2 nor 3 divides), with padding labels and a micro-batch's weight_sum.
TEST(VocabParallel, LossGradientAndArgmaxOverTwoRanksEqualTheWholeLogits) {
  expect_workers_pass(launch_vocab_scenario("vocab_loss", 2));
}

TEST(VocabParallel, LossGradientAndArgmaxOverThreeRanksEqualTheWholeLogits) {
  expect_workers_pass(launch_vocab_scenario("vocab_loss", 3));
}

// GPT-2 split over 2 and 3 ranks (61 ids: uneven either way): loss, gradients and greedy tokens
// equal the unsplit model's with no logits in any collective; what it saves loads unsplit and
// the other way round.
TEST(VocabParallel, GPT2WithItsHeadSplitOverTwoAndThreeRanksEqualsTheUnsplitModel) {
  for (const int T : {2, 3}) {
    const std::string dir = testing::make_temp_dir();
    ASSERT_FALSE(dir.empty());
    const testing::CapturedLaunch run = testing::launch_test_workers(
        "tensor_parallel_tests", "VocabParallelWorker.Run", "vocab_gpt2", T, {{testing::kDirVariable, dir}});
    EXPECT_EQ(run.result.exit_code, 0) << "T=" << T << ": " << run.result.failure << "\n" << run.joined();
    testing::remove_tree(dir);
  }
}

}  // namespace
}  // namespace harness::tensor_parallel
