// weighted_cross_entropy on a case computed by hand, and its errors.
#include "harness/model/loss.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace harness::model {
namespace {

TEST(LossTest, HandComputedWeightedMean) {
  // B=1, T=3, V=2. Token 0: logits (0, 0), label 0 -> CE log 2, weight 1.
  // Token 1: logits (ln 3, 0), label 1 -> CE = log(4), weight 2.
  // Token 2: logits (5, -5), label 1 -> large CE, weight 0 (ignored).
  const at::Tensor logits =
      torch::tensor({0.0f, 0.0f, std::log(3.0f), 0.0f, 5.0f, -5.0f}).reshape({1, 3, 2});
  const at::Tensor labels = torch::tensor({0, 1, 1}, torch::kInt64).reshape({1, 3});
  const at::Tensor weights = torch::tensor({1.0f, 2.0f, 0.0f}).reshape({1, 3});
  const at::Tensor loss = weighted_cross_entropy(logits, labels, weights);
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat32);
  const double expected = (std::log(2.0) + 2.0 * std::log(4.0)) / 3.0;
  EXPECT_NEAR(loss.item<double>(), expected, 1e-6);
}

TEST(LossTest, EqualsMeanCrossEntropyWithUnitWeightsAndBackpropagates) {
  torch::manual_seed(0);
  const at::Tensor logits = torch::randn({2, 4, 7}, torch::requires_grad());
  const at::Tensor labels = torch::randint(0, 7, {2, 4}, torch::kInt64);
  const at::Tensor loss = weighted_cross_entropy(logits, labels, torch::ones({2, 4}));
  const at::Tensor reference =
      torch::nn::functional::cross_entropy(logits.reshape({8, 7}), labels.reshape({8}));
  EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-6);
  loss.backward();
  ASSERT_TRUE(logits.grad().defined());
  EXPECT_GT(logits.grad().abs().sum().item<double>(), 0.0);
}

TEST(LossTest, ZeroWeightsAreAnErrorNamingTheTensor) {
  try {
    weighted_cross_entropy(torch::zeros({1, 2, 3}), torch::zeros({1, 2}, torch::kInt64), torch::zeros({1, 2}));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("label_token_weights"), std::string::npos) << e.what();
  }
}

TEST(LossTest, ShapeMismatchIsAnError) {
  EXPECT_THROW(weighted_cross_entropy(torch::zeros({1, 2, 3}), torch::zeros({1, 3}, torch::kInt64),
                                      torch::ones({1, 3})),
               std::invalid_argument);
  EXPECT_THROW(weighted_cross_entropy(torch::zeros({2, 3}), torch::zeros({2}, torch::kInt64), torch::ones({2})),
               std::invalid_argument);
}

}  // namespace
}  // namespace harness::model
