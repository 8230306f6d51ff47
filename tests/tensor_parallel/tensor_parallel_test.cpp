// Tensor parallelism across real processes (Gloo on CPU): each test starts this binary as
// workers (worker_test.cpp) and passes when every rank's comparisons with the unsplit model pass.
#include <gtest/gtest.h>

#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

void expect_workers_pass(const testing::CapturedLaunch& run) {
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

TEST(TensorParallel, LinearLayersEqualUnsplitForwardAndBackwardWithTwoRanks) {
  expect_workers_pass(testing::launch_scenario("linear", 2));
}

TEST(TensorParallel, GPT2OverTwoRanksEqualsUnsplitAndSavesUnsplitWeights) {
  const std::string dir = testing::make_temp_dir();
  ASSERT_FALSE(dir.empty());
  expect_workers_pass(testing::launch_scenario("gpt2", 2, {{testing::kDirVariable, dir}}));
  testing::remove_tree(dir);
}

TEST(TensorParallel, AdamWStepTensorTwoByDataOneEqualsSingleRank) {
  expect_workers_pass(testing::launch_scenario("step_tp2", 2));
}

TEST(TensorParallel, AdamWStepTensorTwoByDataTwoEqualsSingleRankAverage) {
  expect_workers_pass(testing::launch_scenario("step_tp2", 4));
}

}  // namespace
}  // namespace harness::tensor_parallel
