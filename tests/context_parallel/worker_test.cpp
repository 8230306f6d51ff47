// The worker side of the context-parallel tests: skipped in a normal run; started by
// ring_attention_test.cpp's launcher with HARNESS_TEST_WORKER=<scenario>, it plays that scenario
// over a Gloo group of all the workers, each rank comparing its shard with the full-sequence
// reference it computes itself from the same seed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "harness/context_parallel/group.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "gpt2_check.h"
#include "test_support.h"

namespace harness::context_parallel {
namespace {

namespace dp = harness::data_parallel;
using namespace testing;

// Output and gradients against causal SDPA in fp32 for two shapes and scales, the gathered
// output against the whole, and bf16 against fp32.
void ring_scenario(model::ContextParallelGroup& group) {
  const int C = group.size(), c = group.rank();
  struct Case {
    int64_t batch, chunk;
    double scale;
    uint64_t seed;
  };
  for (const Case& cs : {Case{2, 4, 1 / std::sqrt(8.0), 31}, Case{1, 8, 0.6, 32}}) {
    SCOPED_TRACE("chunk " + std::to_string(cs.chunk));
    const AttentionProblem problem = make_problem(cs.batch, 2, 2 * C * cs.chunk, 8, cs.seed);
    const AttentionResult ring = ring_result(problem, group, cs.scale);
    const AttentionResult reference = sdpa_reference(problem, cs.scale);
    expect_shards_match(ring, reference, C, c);
    EXPECT_TRUE(all_close(model::zigzag_unshard(group.all_gather(ring.out), 2), reference.out)) << "gathered";
  }
  const AttentionProblem problem = make_problem(2, 2, 2 * C * 4, 8, 33);
  const AttentionResult bf16 = ring_result(problem, group, 0.35, 0, {}, at::kBFloat16);
  EXPECT_EQ(bf16.out.scalar_type(), at::kBFloat16);
  SCOPED_TRACE("bf16");
  expect_shards_match(bf16, sdpa_reference(problem, 0.35), C, c, 3e-2, 3e-2);
}

// Each rank draws its blocks' masks from its own generator; the full-sequence attention written
// out with every rank's masks (gathered) gives the same output shards and gradients.
void dropout_scenario(model::ContextParallelGroup& group) {
  const int C = group.size(), c = group.rank();
  const double scale = 0.4, p = 0.2;
  const AttentionProblem problem = make_problem(2, 2, 2 * C * 4, 8, 41);
  const AttentionProblem shard{model::zigzag_shard(problem.q, 2, C, c), model::zigzag_shard(problem.k, 2, C, c),
                               model::zigzag_shard(problem.v, 2, C, c), model::zigzag_shard(problem.weights, 2, C, c)};
  at::Tensor keep;
  const AttentionResult ring = run_attention(shard, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    auto result =
        model::ring_attention_with_keep_mask(q, k, v, group, scale, p, at::detail::createCPUGenerator(100 + c));
    keep = result.keep_mask;
    return result.output;
  });
  const std::vector<at::Tensor> masks = group.all_gather(keep.to(at::kByte));
  const at::Tensor full_keep = model::zigzag_unshard(masks, 2).to(at::kBool);
  const int64_t length = problem.q.size(2);
  ASSERT_EQ(full_keep.sizes(), (at::IntArrayRef{2, 2, length, length}));
  EXPECT_FALSE(full_keep.logical_and(torch::ones({length, length}, torch::kBool).triu(1)).any().item<bool>());
  const double kept = full_keep.sum().item<double>() / (2 * 2 * length * (length + 1) / 2);
  EXPECT_GT(kept, 0.7);
  EXPECT_LT(kept, 0.9);
  expect_shards_match(ring, explicit_reference(problem, scale, full_keep, p), C, c);
}

void group_scenario(model::ContextParallelGroup& group) {
  const int C = group.size(), c = group.rank();
  const int previous = (c + C - 1) % C;
  // Two exchanges in flight at once, of different shapes and dtypes, waited for out of order.
  auto first = group.ring_exchange(torch::full({3}, static_cast<float>(c)));
  auto second = group.ring_exchange(torch::full({2, 2}, 10 * c, torch::kLong));
  EXPECT_TRUE(torch::equal(second->wait(), torch::full({2, 2}, 10 * previous, torch::kLong)));
  EXPECT_TRUE(torch::equal(first->wait(), torch::full({3}, static_cast<float>(previous))));
  // C steps bring a tensor round the ring back to its owner.
  at::Tensor travelling = torch::tensor({static_cast<double>(c)});
  for (int step = 0; step < C; ++step) travelling = group.ring_exchange(travelling)->wait();
  EXPECT_EQ(travelling.item<double>(), c);
  at::Tensor sum = torch::full({2}, c + 1.0);
  group.all_reduce_sum(sum);
  EXPECT_TRUE(torch::equal(sum, torch::full({2}, C * (C + 1) / 2.0)));
  const std::vector<at::Tensor> gathered = group.all_gather(torch::full({2}, c, torch::kLong));
  ASSERT_EQ(static_cast<int>(gathered.size()), C);
  for (int r = 0; r < C; ++r) EXPECT_TRUE(torch::equal(gathered[r], torch::full({2}, r, torch::kLong))) << r;
}

TEST(CpWorker, Run) {
  const char* scenario_text = std::getenv(kWorkerVariable);
  if (scenario_text == nullptr) GTEST_SKIP() << "only run as a worker by the context-parallel launcher tests";
  const std::string scenario = scenario_text;
  const auto env = dp::worker_env_from_environment();
  ASSERT_TRUE(env.has_value()) << "a worker needs RANK/WORLD_SIZE from the launcher";
  at::set_num_threads(1);
  dp::DistOptions options = dp::dist_options_for(*env, dp::Backend::kGloo);
  options.timeout = std::chrono::seconds(60);
  const auto group = make_context_parallel_group(dp::init_process_group(options));

  if (scenario == "ring") {
    ring_scenario(*group);
  } else if (scenario == "dropout") {
    dropout_scenario(*group);
  } else if (scenario == "group") {
    group_scenario(*group);
  } else if (scenario == "gpt2") {
    expect_gpt2_matches_plain(group);
  } else {
    FAIL() << "unknown scenario " << scenario;
  }
  if (!::testing::Test::HasFailure()) {
    std::printf("scenario %s passed on rank %d\n", scenario.c_str(), env->rank);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace harness::context_parallel
