// Ring all-reduce: the chunk plan (pure), the --allreduce names, one rank, and against the
// built-in all-reduce with 2, 3 and 4 processes (worker scenarios "ring", "ring_grad_sync").
#include "harness/data_parallel/ring_all_reduce.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_support.h"

namespace harness::data_parallel {
namespace {

TEST(RingChunks, UnevenChunksCoverTheTensorInOrder) {
  // 10 over 4: 3, 3, 2, 2.
  EXPECT_EQ(ring_chunk_bounds(10, 4, 0), (std::pair<int64_t, int64_t>{0, 3}));
  EXPECT_EQ(ring_chunk_bounds(10, 4, 1), (std::pair<int64_t, int64_t>{3, 6}));
  EXPECT_EQ(ring_chunk_bounds(10, 4, 2), (std::pair<int64_t, int64_t>{6, 8}));
  EXPECT_EQ(ring_chunk_bounds(10, 4, 3), (std::pair<int64_t, int64_t>{8, 10}));
  // Shorter than the world: one element each for the first chunks, the rest empty.
  EXPECT_EQ(ring_chunk_bounds(2, 4, 1), (std::pair<int64_t, int64_t>{1, 2}));
  EXPECT_EQ(ring_chunk_bounds(2, 4, 3), (std::pair<int64_t, int64_t>{2, 2}));
  for (int64_t numel : {0, 1, 5, 7, 1000003}) {
    for (int n = 1; n <= 5; ++n) {
      int64_t expected_begin = 0;
      for (int c = 0; c < n; ++c) {
        const auto [begin, end] = ring_chunk_bounds(numel, n, c);
        EXPECT_EQ(begin, expected_begin) << numel << " over " << n << ", chunk " << c;
        EXPECT_LE(end - begin, (numel + n - 1) / n);
        EXPECT_GE(end - begin, numel / n);
        expected_begin = end;
      }
      EXPECT_EQ(expected_begin, numel);
    }
  }
  EXPECT_THROW(ring_chunk_bounds(10, 4, 4), std::invalid_argument);
}

TEST(AllReduceAlgorithmFlag, ParsesAndNamesTheFlag) {
  EXPECT_EQ(parse_allreduce_algorithm("builtin"), AllReduceAlgorithm::kBuiltin);
  EXPECT_EQ(parse_allreduce_algorithm("ring"), AllReduceAlgorithm::kRing);
  EXPECT_EQ(to_string(AllReduceAlgorithm::kRing), "ring");
  try {
    parse_allreduce_algorithm("tree");
    FAIL() << "accepted --allreduce tree";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--allreduce tree is unknown: use builtin or ring");
  }
}

TEST(RingAllReduce, OneRankLeavesSumAndDividesMeanByOne) {
  DistOptions o;
  o.master_port = testing::free_port();
  o.timeout = std::chrono::seconds(30);
  const DistContext ctx = init_process_group(o);
  at::Tensor t = torch::randn({13});
  const at::Tensor before = t.clone();
  ring_all_reduce(ctx, t);
  EXPECT_TRUE(torch::equal(t, before));
  ring_all_reduce(ctx, t, ReduceKind::kMean);
  EXPECT_TRUE(torch::equal(t, before));
  // The asynchronous thread: results arrive, a failure is rethrown by wait().
  RingAllReduceThread thread(ctx);
  auto ok = thread.all_reduce_async(t, ReduceKind::kSum);
  at::Tensor ints = torch::ones({3}, torch::kInt32);
  auto bad = thread.all_reduce_async(ints, ReduceKind::kMean);
  EXPECT_TRUE(ok->wait());
  EXPECT_THROW(bad->wait(), std::exception);
  EXPECT_THROW(ring_all_reduce(DistContext{}, t), std::exception);  // no process group
}

class RingAcrossProcesses : public ::testing::TestWithParam<int> {};

TEST_P(RingAcrossProcesses, EqualsBuiltinOnRandomDataAndOddLengths) {
  const auto run = testing::launch_scenario("ring", GetParam());
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, RingAcrossProcesses, ::testing::Values(2, 3, 4));

TEST(GradSync, RingEqualsBuiltinForNaiveAndBucketedAcrossThreeProcesses) {
  const auto run = testing::launch_scenario("ring_grad_sync", 3);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

}  // namespace
}  // namespace harness::data_parallel
