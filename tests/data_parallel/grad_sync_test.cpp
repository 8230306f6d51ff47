// Gradient synchronisers: the bucket plan (pure), the bucketed hooks on one rank, and bucketed
// against naive across two processes (worker scenario "bucketed").
#include "harness/data_parallel/grad_sync.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "test_support.h"

namespace harness::data_parallel {
namespace {

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

TEST(BucketedAllReduce, HooksLaunchBucketsDuringBackwardOnOneRank) {
  DistOptions o;
  o.master_port = testing::free_port();
  o.timeout = std::chrono::seconds(30);
  const DistContext ctx = init_process_group(o);
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  auto sync = make_gradient_synchronizer("bucketed", ctx, 64.0 / (1024 * 1024));
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

TEST(GradSync, BucketedEqualsNaiveAcrossTwoProcesses) {
  const auto run = testing::launch_scenario("bucketed", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

// A parameter used on one rank only (and used again after being presumed unused): the ranks
// agree instead of issuing different collectives, and all hold the average.
TEST(GradSync, BucketedAgreesWhenRanksUseDifferentParameters) {
  const auto run = testing::launch_scenario("bucketed_unused_on_one_rank", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(run.joined().find("scenario bucketed_unused_on_one_rank passed on rank " + std::to_string(rank)),
              std::string::npos)
        << run.joined();
  }
}

}  // namespace
}  // namespace harness::data_parallel
