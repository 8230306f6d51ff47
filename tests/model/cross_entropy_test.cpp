// The fused weighted token cross entropy against torch's cross_entropy times the weights: values and
// gradients, ignored labels, extreme logits, odd vocabulary sizes and thread counts; bad labels throw.
#include "harness/model/cross_entropy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace harness::model {
namespace {

at::Tensor reference(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& weights) {
  const at::Tensor per_token = torch::nn::functional::cross_entropy(
      logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (per_token * weights).sum();
}

// max|a - b| <= rtol * max|b| + atol, reported with the numbers.
::testing::AssertionResult close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol = 1e-7) {
  const double err = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  const double scale = b.abs().max().item<double>();
  if (err <= rtol * scale + atol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max|a-b| = " << err << " > " << rtol << " * " << scale << " + " << atol;
}

TEST(WeightedTokenCrossEntropy, EqualsTorchsCrossEntropyTimesWeightsWithItsGradient) {
  const int threads = at::get_num_threads();
  for (const int64_t V : {1417, 97, 16, 1}) {
    for (const int n_threads : {1, 2}) {
      SCOPED_TRACE("V " + std::to_string(V) + ", threads " + std::to_string(n_threads));
      at::set_num_threads(n_threads);
      torch::manual_seed(V);
      const int64_t N = 301;
      at::Tensor base = torch::randn({N, V}) * 4;
      base[5] = base[5] * 20;  // a row with logits in the hundreds: the shift by its maximum matters
      base[6].fill_(-1e4);     // and one far down
      const at::Tensor logits = base.detach().requires_grad_();
      at::Tensor labels = torch::randint(V, {N}, torch::kLong);
      labels[3] = -100;  // torch's ignore_index: counts 0, no gradient
      labels[7] = -100;
      const at::Tensor weights = torch::rand({N}) * (torch::rand({N}) > 0.2).to(torch::kFloat);
      const at::Tensor upstream = torch::tensor(0.7f);

      const at::Tensor fused = weighted_token_cross_entropy_sum(logits, labels, weights);
      const at::Tensor expected = reference(logits, labels, weights);
      EXPECT_TRUE(close(fused, expected, 1e-5));
      const at::Tensor grad = torch::autograd::grad({fused}, {logits}, {upstream})[0];
      const at::Tensor expected_grad = torch::autograd::grad({expected}, {logits}, {upstream})[0];
      EXPECT_TRUE(close(grad, expected_grad, 1e-5));
      EXPECT_TRUE(torch::equal(grad[3], torch::zeros({V}))) << "an ignored token has no gradient";
    }
  }
  at::set_num_threads(threads);
}

TEST(WeightedTokenCrossEntropy, TakesTransposedLogitsAndOtherDtypesThroughTorch) {
  torch::manual_seed(2);
  const at::Tensor labels = torch::randint(40, {30}, torch::kLong);
  const at::Tensor weights = torch::rand({30});
  const at::Tensor transposed = torch::randn({40, 30}).t();  // not contiguous
  EXPECT_TRUE(close(weighted_token_cross_entropy_sum(transposed, labels, weights),
                    reference(transposed, labels, weights), 1e-5));
  const at::Tensor doubles = torch::randn({30, 40}, torch::kDouble);
  EXPECT_TRUE(close(weighted_token_cross_entropy_sum(doubles, labels, weights.to(torch::kDouble)),
                    reference(doubles, labels, weights.to(torch::kDouble)), 1e-12));
}

// The gradient takes the logits' place where nothing but the loss holds them (a head's output,
// reshaped to rows or not), bit for bit the gradient written apart; logits anyone else holds, or a
// graph kept for another backward, are left as they were.
TEST(WeightedTokenCrossEntropy, WritesItsGradientOverLogitsOnlyItHolds) {
  torch::manual_seed(3);
  const int64_t B = 4, T = 16, V = 97;
  const at::Tensor leaf = torch::randn({B, T, V}).requires_grad_();
  const at::Tensor labels = torch::randint(V, {B * T}, torch::kLong);
  labels[5] = -100;
  const at::Tensor weights = torch::rand({B * T});
  // The loss of leaf * 2 (whose backward saves nothing of it), with the logits' gradient's address.
  struct Run {
    at::Tensor grad;
    const void* logits_at = nullptr;
    const void* logits_grad_at = nullptr;
  };
  const auto run = [&](bool caller_keeps, bool as_view, bool retain) {
    Run out;
    at::Tensor loss, kept, before;
    {
      const at::Tensor logits = leaf * 2;
      logits.register_hook([&out](const at::Tensor& g) { out.logits_grad_at = g.data_ptr(); });
      const at::Tensor rows = as_view ? logits.view({B * T, V}) : logits.reshape({B * T, V}).clone();
      out.logits_at = rows.data_ptr();  // the gradient passes back through view and clone as it is
      if (caller_keeps) {
        kept = rows;
        before = rows.detach().clone();
      }
      loss = weighted_token_cross_entropy_sum(rows, labels, weights);
    }
    out.grad = torch::autograd::grad({loss}, {leaf}, {}, /*retain_graph=*/retain)[0];
    if (retain) {
      const at::Tensor again = torch::autograd::grad({loss}, {leaf})[0];
      EXPECT_TRUE(torch::equal(again, out.grad)) << "a second backward of a kept graph";
    }
    if (caller_keeps) EXPECT_TRUE(torch::equal(kept, before)) << "the caller's logits were written over";
    return out;
  };
  const Run apart = run(/*caller_keeps=*/true, /*as_view=*/true, /*retain=*/false);
  EXPECT_NE(apart.logits_grad_at, apart.logits_at);
  for (const bool as_view : {true, false}) {
    SCOPED_TRACE(as_view ? "a view of the head's output" : "a tensor of its own");
    const Run in_place = run(false, as_view, false);
    EXPECT_EQ(in_place.logits_grad_at, in_place.logits_at);  // the loss's rows' storage
    EXPECT_TRUE(torch::equal(in_place.grad, apart.grad));
  }
  const Run retained = run(false, true, /*retain=*/true);
  EXPECT_TRUE(torch::equal(retained.grad, apart.grad));
  const at::Tensor expected = torch::autograd::grad({reference(leaf.view({B * T, V}) * 2, labels, weights)}, {leaf})[0];
  EXPECT_TRUE(close(apart.grad, expected, 1e-5));
}

TEST(WeightedTokenCrossEntropy, ALabelOutsideTheVocabularyIsNamed) {
  const at::Tensor logits = torch::randn({4, 10});
  const at::Tensor weights = torch::ones({4});
  for (const int64_t bad : {10, -1, -101}) {
    const at::Tensor labels = torch::tensor({int64_t{1}, int64_t{2}, bad, int64_t{3}}, torch::kLong);
    try {
      weighted_token_cross_entropy_sum(logits, labels, weights);
      ADD_FAILURE() << "label " << bad << " was accepted";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("label " + std::to_string(bad) + " of token 2"), std::string::npos) << message;
      EXPECT_NE(message.find("[0, 10)"), std::string::npos) << message;
    }
  }
  EXPECT_THROW(weighted_token_cross_entropy_sum(logits, torch::zeros({3}, torch::kLong), weights), c10::Error);
}

}  // namespace
}  // namespace harness::model
