// Gradient synchronisers: the bucket plan (pure), the bucketed hooks on one rank, and bucketed
// against naive across two processes (worker scenario "bucketed").
#include "harness/data_parallel/grad_sync.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/debug_sync.h"
#include "test_support.h"

namespace harness::data_parallel {
namespace {

using testing::one_rank;

TEST(BucketPlan, ReverseOrderCappedAndSplitByDtype) {
  // float32 sizes in bytes: 320, 64, 1024, 64, 192, 12; cap 400.
  std::vector<at::Tensor> params = {
      torch::zeros({16, 5}, torch::requires_grad()), torch::zeros({16}, torch::requires_grad()),
      torch::zeros({16, 16}, torch::requires_grad()), torch::zeros({16}, torch::requires_grad()),
      torch::zeros({3, 16}, torch::requires_grad()), torch::zeros({3}, torch::requires_grad())};
  EXPECT_EQ(plan_buckets(params, 400),
            (std::vector<std::vector<size_t>>{{5, 4, 3}, {2}, {1, 0}}));
  EXPECT_EQ(plan_buckets(params, 1 << 20), (std::vector<std::vector<size_t>>{{5, 4, 3, 2, 1, 0}}));
  // Frozen parameters are skipped; a dtype change starts a new bucket.
  params[3] = torch::zeros({16});
  params[1] = torch::zeros({16}, torch::dtype(torch::kFloat64).requires_grad(true));
  EXPECT_EQ(plan_buckets(params, 1 << 20),
            (std::vector<std::vector<size_t>>{{5, 4, 2}, {1}, {0}}));
}

// A flat layout cut into chunks of 4 (ranks 0-2 own [0,4), [4,8), [8,12)): where tensors meet
// each rank's chunk.
TEST(ChunkOverlap, WhereATensorMeetsEachRanksChunk) {
  auto of = [](int64_t rank, int64_t offset, int64_t n) {
    const ChunkOverlap o = chunk_overlap(rank, 4, offset, n);
    return std::vector<int64_t>{o.in_chunk, o.in_tensor, o.length};
  };
  using V = std::vector<int64_t>;
  EXPECT_EQ(of(0, 0, 3), (V{0, 0, 3}));   // inside rank 0's chunk
  EXPECT_EQ(of(1, 0, 3), (V{0, 0, 0}));   // not in rank 1's
  EXPECT_EQ(of(0, 3, 6), (V{3, 0, 1}));   // [3, 9): its first element on rank 0,
  EXPECT_EQ(of(1, 3, 6), (V{0, 1, 4}));   // the next four on rank 1,
  EXPECT_EQ(of(2, 3, 6), (V{0, 5, 1}));   // its last on rank 2
  EXPECT_EQ(of(2, 9, 3), (V{1, 0, 3}));   // ends where the layout ends
  EXPECT_EQ(of(2, 12, 2), (V{0, 0, 0}));  // in the padding past the last chunk: nowhere
}

// A tied weight's copy on another pipeline stage must be laid out alike in ZeRO's chunks: kept
// apart, it gets a bucket of its own wherever it falls, the order of the rest unchanged.
TEST(BucketPlan, KeptApartParametersGetBucketsOfTheirOwn) {
  const std::vector<std::vector<size_t>> plan{{5, 4, 3}, {2}, {1, 0}};
  EXPECT_EQ(keep_apart_in_plan(plan, {0}), (std::vector<std::vector<size_t>>{{5, 4, 3}, {2}, {1}, {0}}));
  EXPECT_EQ(keep_apart_in_plan(plan, {4}), (std::vector<std::vector<size_t>>{{5}, {4}, {3}, {2}, {1, 0}}));
  EXPECT_EQ(keep_apart_in_plan(plan, {2, 5}), (std::vector<std::vector<size_t>>{{5}, {4, 3}, {2}, {1, 0}}));
  EXPECT_EQ(keep_apart_in_plan(plan, {}), plan);
}

TEST(BucketedAllReduce, HooksLaunchBucketsDuringBackwardOnOneRank) {
  const DistContext ctx = one_rank();
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  auto sync = make_gradient_synchronizer(GradientSyncKind::kBucketed, ctx, 64.0 / (1024 * 1024));
  sync->attach(*model);
  const auto* bucketed = dynamic_cast<const BucketedAllReduce*>(sync.get());
  ASSERT_NE(bucketed, nullptr);
  // A 64-byte cap puts each of the four tensors (128, 32, 64 and 8 bytes) in its own bucket.
  EXPECT_EQ(bucketed->bucket_plan(), (std::vector<std::vector<size_t>>{{3}, {2}, {1}, {0}}));
  model->forward(torch::randn({5, 4})).sum().backward();
  std::vector<at::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.grad().clone());
  sync->finalize();
  EXPECT_EQ(bucketed->launched_during_backward(), 4);
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i].grad(), before[i]));
  EXPECT_THROW(BucketedAllReduce(ctx, 0.0), std::invalid_argument);
}

// A step that accumulates each gradient k = 3 times (a schedule's micro-batches): a bucket starts
// only at its parameters' third accumulation, never before, and the result is the sum of the three
// (one rank: the average is the sum itself). A fourth accumulation after the launch is reduced again.
TEST(BucketedAllReduce, BucketsExpectingKAccumulationsLaunchOnlyAfterTheKth) {
  const DistContext ctx = one_rank();
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  BucketedAllReduce bucketed(ctx, 64.0 / (1024 * 1024));  // four buckets, one per tensor
  bucketed.attach(*model);
  EXPECT_THROW(bucketed.set_expected_accumulations(0), std::invalid_argument);
  const at::Tensor x = torch::randn({4, 5, 4});
  for (int extra : {0, 1}) {
    SCOPED_TRACE(extra ? "one accumulation more than expected" : "as expected");
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    bucketed.set_expected_accumulations(3);
    const int64_t bytes = bucketed.communicated_bytes();
    for (int k = 0; k < 3 + extra; ++k) {
      EXPECT_EQ(bucketed.launched_in_step(), k < 3 ? 0 : 4) << "before backward " << k;
      model->forward(x[k]).pow(2).sum().backward();
    }
    EXPECT_EQ(bucketed.launched_in_step(), 4);
    std::vector<at::Tensor> expected;
    for (const auto& p : model->parameters()) expected.push_back(p.grad().clone());
    bucketed.finalize();
    EXPECT_EQ(bucketed.launched_during_backward(), 4);
    EXPECT_EQ(bucketed.launched_in_step(), 0);
    const int64_t gradient_bytes = 4 * (8 * 4 + 8 + 2 * 8 + 2);
    // The stale buckets go again (every one, after the fourth backward); then the agreement flags.
    EXPECT_EQ(bucketed.communicated_bytes() - bytes, (extra ? 2 : 1) * gradient_bytes + 4 * (4 + 4));
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i].grad(), expected[i])) << i;
  }
}

// DDP's no_sync: 4 backward passes, the first 3 under no_sync, reduce once: the gradients are the
// sum of the 4, the buckets start during the last backward only, and the bytes sent are one
// step's, for both kinds.
TEST(GradSync, NoSyncAccumulatesLocallyAndReducesOnce) {
  const DistContext ctx = one_rank();
  for (const std::string kind : {"bucketed", "naive"}) {
    SCOPED_TRACE(kind);
    torch::manual_seed(3);
    torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    auto sync = make_gradient_synchronizer(parse_gradient_sync(kind), ctx, 64.0 / (1024 * 1024));
    sync->attach(*model);
    model->forward(torch::randn({5, 4})).sum().backward();
    sync->finalize();
    const int64_t one_step = sync->communicated_bytes();
    EXPECT_GT(one_step, 4 * (8 * 4 + 8 + 2 * 8 + 2) - 1);  // at least every gradient once
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();

    std::vector<at::Tensor> expected;
    const at::Tensor x = torch::randn({4, 5, 4});
    for (int k = 0; k < 4; ++k) {
      sync->set_no_sync(k < 3);
      model->forward(x[k]).pow(2).sum().backward();
    }
    for (const auto& p : model->parameters()) expected.push_back(p.grad().clone());
    sync->finalize();
    EXPECT_EQ(sync->communicated_bytes() - one_step, one_step);
    if (const auto* bucketed = dynamic_cast<const BucketedAllReduce*>(sync.get())) {
      EXPECT_EQ(bucketed->launched_during_backward(), 4);  // all four buckets, in the last backward
    }
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i].grad(), expected[i]));
  }
}

// --grad_reduce_dtype bf16: the gradients cross the wire as bf16 (half the bytes) and come back
// as fp32 holding the bf16-rounded values (one rank: the rounding is all that happens).
TEST(GradSync, Bf16ReductionHalvesTheBytesAndRoundsToBf16) {
  const DistContext ctx = one_rank();
  for (const std::string kind : {"bucketed", "naive"}) {
    SCOPED_TRACE(kind);
    int64_t fp32_bytes = 0;
    for (const bool bf16 : {false, true}) {
      torch::manual_seed(3);
      torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
      auto sync = make_gradient_synchronizer(parse_gradient_sync(kind), ctx);
      if (bf16) sync->set_reduce_dtype(at::kBFloat16);
      sync->attach(*model);
      model->forward(torch::randn({5, 4})).pow(2).sum().backward();
      std::vector<at::Tensor> local;
      for (const auto& p : model->parameters()) local.push_back(p.grad().clone());
      sync->finalize();
      const auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(params[i].grad().scalar_type(), at::kFloat);
        const at::Tensor expected = bf16 ? local[i].to(at::kBFloat16).to(at::kFloat) : local[i];
        EXPECT_TRUE(torch::equal(params[i].grad(), expected)) << "parameter " << i;
      }
      // Gradient bytes halve; the agreement flags (int32, one per parameter) stay.
      const int64_t flags = 4 * static_cast<int64_t>(params.size()) + (kind == "bucketed" ? 4 : 0);
      if (!bf16) fp32_bytes = sync->communicated_bytes();
      if (bf16) {
        EXPECT_EQ(2 * (sync->communicated_bytes() - flags), fp32_bytes - flags);
      }
    }
  }
}

TEST(GradSync, BucketedEqualsNaiveAcrossTwoProcesses) {
  const auto run = testing::launch_scenario("bucketed", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

// A parameter used on one rank only (and used again after being presumed unused): the ranks
// agree instead of issuing different collectives, and all hold the average; for both kinds.
// Returns the ranks' output.
std::string expect_scenario_passed_on_every_rank(const std::string& scenario) {
  const auto run = testing::launch_scenario(scenario, 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(run.joined().find("scenario " + scenario + " passed on rank " + std::to_string(rank)),
              std::string::npos)
        << run.joined();
  }
  return run.joined();
}

TEST(GradSync, BucketedAgreesWhenRanksUseDifferentParameters) {
  expect_scenario_passed_on_every_rank("bucketed_unused_on_one_rank");
}

TEST(GradSync, NaiveAgreesWhenRanksUseDifferentParameters) {
  expect_scenario_passed_on_every_rank("naive_unused_on_one_rank");
}

TEST(Zero, ShardedAdamWTakesAdamWsStepsOverTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    const auto run = testing::launch_scenario("zero", world);
    EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_NE(run.joined().find("scenario zero passed on rank " + std::to_string(rank)), std::string::npos)
          << run.joined();
    }
  }
}

TEST(Zero, ShardedGradientsAccumulateIntoTheChunksAndTakeAdamWsStepsOverTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    const auto run = testing::launch_scenario("zero2", world);
    EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_NE(run.joined().find("scenario zero2 passed on rank " + std::to_string(rank)), std::string::npos)
          << run.joined();
    }
  }
}

TEST(DebugSync, FingerprintNamesSequenceOperationDtypesAndShapes) {
  EXPECT_EQ(collective_fingerprint(3, "allreduce", "SUM", {torch::zeros({2, 5}), torch::zeros({7}, torch::kInt)}),
            "#3 allreduce(SUM) float32[2,5] int32[7]");
  EXPECT_EQ(collective_fingerprint(0, "barrier", "", {}), "#0 barrier");
  EXPECT_EQ(collective_fingerprint(1, "broadcast", "root 0", {torch::zeros({}, torch::kFloat64)}),
            "#1 broadcast(root 0) float64[]");
}

TEST(DebugSync, MatchingCollectivesGoThroughAcrossTwoProcesses) {
  expect_scenario_passed_on_every_rank("debug_sync_agree");
}

// Rank 0 all-reduces 4 floats, rank 1 five: both fail at once with both ranks' views.
TEST(DebugSync, RankThatNeverArrivesIsNamedAfterTheTimeout) {
  expect_scenario_passed_on_every_rank("debug_sync_missing");
}

TEST(DebugSync, MismatchFailsOnEveryRankWithEveryRanksView) {
  const std::string output = expect_scenario_passed_on_every_rank("debug_sync_mismatch");
  EXPECT_NE(output.find("rank 0: #1 allreduce(SUM) float32[4]; rank 1: #1 allreduce(SUM) float32[5]"),
            std::string::npos)
      << output;
}

}  // namespace
}  // namespace harness::data_parallel
