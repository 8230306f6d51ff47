// Helpers for the context-parallel tests: full-sequence references that every rank computes from
// the same seed, a group of one for single-process checks, and the launcher of the multi-process
// scenarios (the test binary re-runs itself as workers of CpWorker.Run, tests/support/multi_process.h).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../support/multi_process.h"
#include "harness/model/context_parallel.h"

namespace harness::context_parallel::testing {

using namespace harness::test_workers;

// Runs `world_size` copies of this test binary in scenario `scenario` (CpWorker.Run).
inline CapturedLaunch launch_scenario(const std::string& scenario, int world_size) {
  return launch_test_workers("context_parallel_tests", "CpWorker.Run", scenario, world_size);
}

// The message of the std::invalid_argument `fn` throws, or a note that it threw none.
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument)";
}

// Every worker of `run` passed its scenario.
inline void expect_workers_pass(const CapturedLaunch& run) {
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

// Full-sequence q, k, v [B, H, S, D] and the weights of the loss sum(out * weights).
struct AttentionProblem {
  at::Tensor q, k, v, weights;
};

inline AttentionProblem make_problem(int64_t batch, int64_t heads, int64_t length, int64_t dim, uint64_t seed) {
  torch::manual_seed(seed);
  AttentionProblem p;
  p.q = torch::randn({batch, heads, length, dim});
  p.k = torch::randn({batch, heads, length, dim});
  p.v = torch::randn({batch, heads, length, dim});
  p.weights = torch::randn({batch, heads, length, dim});
  return p;
}

// An attention's output and the gradients of sum(out * weights) with respect to q, k and v.
struct AttentionResult {
  at::Tensor out, grad_q, grad_k, grad_v;
};

// A copy of x as a leaf that requires grad (never x itself, which other computations share).
inline at::Tensor fresh_leaf(const at::Tensor& x, at::ScalarType dtype) {
  return x.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
}

// fn(q, k, v) -> out, differentiated at the problem's tensors (cast to `dtype`).
template <typename Fn>
AttentionResult run_attention(const AttentionProblem& p, Fn fn, at::ScalarType dtype = at::kFloat) {
  at::Tensor q = fresh_leaf(p.q, dtype);
  at::Tensor k = fresh_leaf(p.k, dtype);
  at::Tensor v = fresh_leaf(p.v, dtype);
  const at::Tensor out = fn(q, k, v);
  (out.to(at::kFloat) * p.weights).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// The one-device reference: PyTorch's causal scaled dot-product attention.
inline AttentionResult sdpa_reference(const AttentionProblem& p, double scale) {
  return run_attention(p, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale);
  });
}

// Attention written out with a given keep-mask [B, H, S, S] (false above the diagonal):
// (softmax(causal(Q K^T * scale)) * keep / (1 - p)) V.
inline AttentionResult explicit_reference(const AttentionProblem& p, double scale, const at::Tensor& keep,
                                          double dropout_p) {
  return run_attention(p, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const int64_t n = q.size(2);
    const at::Tensor future = torch::ones({n, n}, torch::kBool).triu(1);
    const at::Tensor probs = torch::softmax(torch::matmul(q, k.transpose(-2, -1)).mul(scale).masked_fill(future, -INFINITY), -1);
    return torch::matmul(probs * keep / (1 - dropout_p), v);
  });
}

// Ring attention on this rank's shards of the problem; its result holds this rank's shards.
inline AttentionResult ring_result(const AttentionProblem& full, model::ContextParallelGroup& group, double scale,
                                   double dropout_p = 0, std::optional<at::Generator> generator = {},
                                   at::ScalarType dtype = at::kFloat) {
  const int C = group.size(), c = group.rank();
  const AttentionProblem shard{model::zigzag_shard(full.q, 2, C, c), model::zigzag_shard(full.k, 2, C, c),
                               model::zigzag_shard(full.v, 2, C, c), model::zigzag_shard(full.weights, 2, C, c)};
  return run_attention(
      shard,
      [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
        return model::ring_attention(q, k, v, group, scale, dropout_p, generator);
      },
      dtype);
}

inline ::testing::AssertionResult all_close(const at::Tensor& got, const at::Tensor& want, double rtol = 1e-4,
                                            double atol = 1e-5) {
  if (got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " vs " << want.sizes();
  }
  const at::Tensor g = got.to(at::kFloat), w = want.to(at::kFloat);
  if (torch::allclose(g, w, rtol, atol)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs difference " << (g - w).abs().max().item<double>()
                                       << " (rtol " << rtol << ", atol " << atol << ")";
}

// The ring's shards against the reference's, output and the three gradients.
inline void expect_shards_match(const AttentionResult& ring, const AttentionResult& reference, int C, int c,
                                double rtol = 1e-4, double atol = 1e-5) {
  EXPECT_TRUE(all_close(ring.out, model::zigzag_shard(reference.out, 2, C, c), rtol, atol)) << "output";
  EXPECT_TRUE(all_close(ring.grad_q, model::zigzag_shard(reference.grad_q, 2, C, c), rtol, atol)) << "dq";
  EXPECT_TRUE(all_close(ring.grad_k, model::zigzag_shard(reference.grad_k, 2, C, c), rtol, atol)) << "dk";
  EXPECT_TRUE(all_close(ring.grad_v, model::zigzag_shard(reference.grad_v, 2, C, c), rtol, atol)) << "dv";
}

// A group of one in this process: ring attention without communication.
class SoloGroup : public model::ContextParallelGroup {
 public:
  struct Ready : Exchange {
    explicit Ready(at::Tensor t) : tensor(std::move(t)) {}
    at::Tensor wait() override { return tensor; }
    at::Tensor tensor;
  };
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::unique_ptr<Exchange> ring_exchange(const at::Tensor& to_next) override {
    ++exchanges;
    return std::make_unique<Ready>(to_next.clone());
  }
  void all_reduce_sum(at::Tensor&) override {}
  std::vector<at::Tensor> all_gather(const at::Tensor& x) override { return {x.clone()}; }
  int exchanges = 0;
};

}  // namespace harness::context_parallel::testing
