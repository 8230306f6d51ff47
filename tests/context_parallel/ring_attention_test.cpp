// Ring attention against PyTorch's causal attention: in this process for one rank, and over
// 2, 3 and 4 real processes (Gloo) through the workers of worker_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "harness/context_parallel/group.h"
#include "test_support.h"

namespace harness::context_parallel {
namespace {

using namespace testing;

// ----- One rank, in this process -------------------------------------------------------------------

TEST(RingAttention, OneRankIsCausalAttentionOverItsChunksInOrderWithoutCommunication) {
  SoloGroup group;
  const std::vector<std::pair<int64_t, double>> cases = {{8, 1 / std::sqrt(8.0)}, {16, 0.7}};
  for (const auto& [length, scale] : cases) {
    SCOPED_TRACE("length " + std::to_string(length));
    const AttentionProblem problem = make_problem(2, 2, length, 8, 21);
    expect_shards_match(ring_result(problem, group, scale), sdpa_reference(problem, scale), 1, 0);
  }
  EXPECT_EQ(group.exchanges, 0) << "a ring of one sends nothing";
}

TEST(RingAttention, OneRankDropoutMatchesExplicitAttentionWithTheMaskItDrew) {
  SoloGroup group;
  const AttentionProblem problem = make_problem(2, 2, 16, 8, 22);
  const double scale = 0.35, p = 0.25;
  at::Tensor keep;
  const AttentionResult ring = run_attention(problem, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    auto result = model::ring_attention_with_keep_mask(q, k, v, group, scale, p, at::detail::createCPUGenerator(7));
    keep = result.keep_mask;
    return result.output;
  });
  ASSERT_EQ(keep.sizes(), (at::IntArrayRef{2, 2, 16, 16}));
  ASSERT_EQ(keep.scalar_type(), at::kBool);
  // Nothing above the diagonal; about 1 - p of the rest kept.
  EXPECT_FALSE(keep.logical_and(torch::ones({16, 16}, torch::kBool).triu(1)).any().item<bool>());
  const double kept = keep.sum().item<double>() / (2 * 2 * 16 * 17 / 2);
  EXPECT_GT(kept, 0.6);
  EXPECT_LT(kept, 0.9);
  expect_shards_match(ring, explicit_reference(problem, scale, keep, p), 1, 0);
  // The same generator seed draws the same masks; another seed others.
  const AttentionResult again = ring_result(problem, group, scale, p, at::detail::createCPUGenerator(7));
  EXPECT_TRUE(torch::equal(again.out, ring.out));
  EXPECT_TRUE(torch::equal(again.grad_k, ring.grad_k));
  const AttentionResult other = ring_result(problem, group, scale, p, at::detail::createCPUGenerator(8));
  EXPECT_FALSE(torch::allclose(other.out, ring.out));
}

TEST(RingAttention, DropoutZeroDrawsNothingAndIsTheCausalPattern) {
  SoloGroup group;
  const AttentionProblem problem = make_problem(1, 2, 8, 8, 23);
  at::Generator generator = at::detail::createCPUGenerator(5);
  const uint64_t before = generator.current_seed();
  const at::Tensor state = generator.get_state();
  auto result = model::ring_attention_with_keep_mask(problem.q, problem.k, problem.v, group, 0.5, 0, generator);
  EXPECT_EQ(generator.current_seed(), before);
  EXPECT_TRUE(torch::equal(generator.get_state(), state)) << "the generator was drawn from";
  EXPECT_TRUE(torch::equal(result.keep_mask[0][0], torch::ones({8, 8}, torch::kBool).tril()));
  EXPECT_TRUE(all_close(result.output, sdpa_reference(problem, 0.5).out));
}

TEST(RingAttention, Bf16OnOneRankIsWithinBf16ToleranceOfFp32) {
  SoloGroup group;
  const AttentionProblem problem = make_problem(2, 2, 16, 8, 24);
  const double scale = 1 / std::sqrt(8.0);
  const AttentionResult ring = ring_result(problem, group, scale, 0, {}, at::kBFloat16);
  EXPECT_EQ(ring.out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(ring.grad_q.scalar_type(), at::kBFloat16);
  expect_shards_match(ring, sdpa_reference(problem, scale), 1, 0, 3e-2, 3e-2);
}

TEST(RingAttention, InputsThatAreNotAZigzagShardAreRefusedWithTheReason) {
  SoloGroup group;
  const at::Tensor odd = torch::zeros({1, 2, 7, 8});
  EXPECT_NE(error_of([&] { model::ring_attention(odd, odd, odd, group, 1); })
                .find("ring_attention: q holds 7 positions along dim 2; a zigzag shard holds two equal"),
            std::string::npos);
  const at::Tensor q = torch::zeros({1, 2, 8, 8});
  EXPECT_NE(error_of([&] { model::ring_attention(q, torch::zeros({1, 2, 6, 8}), q, group, 1); })
                .find("ring_attention: k is [1, 2, 6, 8] Float on cpu, q is [1, 2, 8, 8] Float on cpu"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model::ring_attention(q, q, q.to(at::kDouble), group, 1); }).find("v is [1, 2, 8, 8] Double"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model::ring_attention(q[0], q[0], q[0], group, 1); })
                .find("q has shape [2, 8, 8], expected [B, H, 2L, D]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model::ring_attention(q, q, q, group, 1, 1.0); }).find("dropout_p 1.000000 is not in [0, 1)"),
            std::string::npos);
  // The sequence the shards come from: its length must split into 2C chunks.
  EXPECT_NE(error_of([] { model::zigzag_shard(torch::zeros({1, 2, 12, 8}), 2, 4, 0); })
                .find("sequence length 12 is not divisible by 2 x --context_parallel_size 4 = 8"),
            std::string::npos);
}

TEST(ContextParallelGroup, AContextWithoutProcessGroupIsRefused) {
  EXPECT_EQ(error_of([] { make_context_parallel_group(data_parallel::DistContext{}); }),
            "context-parallel group: the DistContext has no process group");
}

// ----- Real processes ----------------------------------------------------------------------------

TEST(RingAttention, TwoRanksMatchCausalSdpaOutputAndGradients) { expect_workers_pass(launch_scenario("ring", 2)); }

TEST(RingAttention, ThreeRanksMatchCausalSdpaOutputAndGradients) { expect_workers_pass(launch_scenario("ring", 3)); }

TEST(RingAttention, FourRanksMatchCausalSdpaOutputAndGradients) { expect_workers_pass(launch_scenario("ring", 4)); }

TEST(RingAttention, DropoutOverThreeRanksMatchesExplicitAttentionWithTheSameMasks) {
  expect_workers_pass(launch_scenario("dropout", 3));
}

TEST(ContextParallelGroup, RingExchangesAllReduceAndAllGatherOverThreeRanks) {
  expect_workers_pass(launch_scenario("group", 3));
}

}  // namespace
}  // namespace harness::context_parallel
