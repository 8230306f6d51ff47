// Tensor parallelism across real processes (Gloo on CPU): each test starts this binary as
// workers (worker_test.cpp) and passes when every rank's comparisons with the unsplit model pass.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

void expect_workers_pass(const testing::CapturedLaunch& run) {
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

TEST(TensorParallel, ColumnAndRowParallelConv1DEqualUnsplitForwardAndBackwardWithTwoRanks) {
  expect_workers_pass(testing::launch_scenario("linear", 2));
}

// Logits, gradients, save and load (slices read by each rank), KV-cached generation token for
// token, dropout streams; then Hugging Face loads what the split model saved and computes the
// unsplit model's logits.
TEST(TensorParallel, GPT2OverTwoRanksEqualsUnsplitAndSavesWhatHuggingFaceLoads) {
  const std::string dir = testing::make_temp_dir();
  ASSERT_FALSE(dir.empty());
  expect_workers_pass(testing::launch_scenario("gpt2", 2, {{testing::kDirVariable, dir}}));
  const std::string python = std::string(HARNESS_SOURCE_DIR) + "/.venv/bin/python";
  if (std::filesystem::exists(python)) {
    const std::string cmd = "'" + python + "' '" + HARNESS_SOURCE_DIR + "/tests/model/hf_load_check.py' '" + dir +
                            "/model' > '" + dir + "/check.log' 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream log(dir + "/check.log");
    const std::string output((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    EXPECT_EQ(rc, 0) << output;
  } else {
    ADD_FAILURE() << "no Python environment at " << python << " to load the saved model with transformers";
  }
  testing::remove_tree(dir);
}

// Sequence parallelism's two collectives and their gradients, against the sums they stand for.
TEST(TensorParallel, SequenceGatherAndReduceScatterWithTwoAndThreeRanks) {
  expect_workers_pass(testing::launch_scenario("sequence_collectives", 2));
  expect_workers_pass(testing::launch_scenario("sequence_collectives", 3));
}

// Loss, every gradient and the logits of GPT-2 with its sequence split between the layers equal
// the unsplit model's; generation stays whole; dropout keeps the default generators in step.
TEST(TensorParallel, SequenceParallelGPT2OverTwoRanksEqualsUnsplit) {
  expect_workers_pass(testing::launch_scenario("sequence_parallel_gpt2", 2));
}

TEST(TensorParallel, AdamWStepTensorTwoByDataOneEqualsSingleRank) {
  expect_workers_pass(testing::launch_scenario("step_tp2", 2));
}

TEST(TensorParallel, AdamWStepTensorTwoByDataTwoEqualsSingleRankAverage) {
  expect_workers_pass(testing::launch_scenario("step_tp2", 4));
}

}  // namespace
}  // namespace harness::tensor_parallel
