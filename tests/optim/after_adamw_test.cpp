// The rule the suite compares weights by after AdamW steps (tests/support/after_adamw.h): the
// update bound holds for AdamW's real updates whatever the gradients, the rule accepts two runs
// whose gradients differ by rounding, and it refuses a run that lost part of its gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "../support/after_adamw.h"
#include "harness/optim/fused_adamw.h"

namespace harness::optim {
namespace {

using test_support::adam_update_bound;
using test_support::AdamWSteps;
using test_support::agree_after_adamw;

TEST(AfterAdamW, UpdateBoundIsOneAtTheFirstStepAndGrowsSlowly) {
  EXPECT_DOUBLE_EQ(adam_update_bound(1, 0.9, 0.999), 1.0);
  EXPECT_NEAR(adam_update_bound(2, 0.9, 0.999), 1.0013579, 1e-6);
  EXPECT_NEAR(adam_update_bound(8, 0.9, 0.999), 1.0278254, 1e-6);
  // Its limit: (1 - b1) / sqrt(1 - b2) / sqrt(1 - b1^2 / b2).
  EXPECT_NEAR(adam_update_bound(20000, 0.9, 0.999), 0.1 / std::sqrt(0.001) / std::sqrt(1.0 - 0.81 / 0.999), 1e-6);
}

// Gradients chosen to push the ratio: magnitudes from 1e-12 to 10, zeros after large ones and
// large ones after zeros, signs that flip. No element's step (weight decay taken out) is ever
// larger than lr R_t.
TEST(AfterAdamW, NoAdamWUpdateExceedsTheBound) {
  torch::manual_seed(7);
  const int64_t n = 4096;
  at::Tensor p = torch::randn({n}, torch::kFloat64).requires_grad_(true);
  const double lr = 1e-3, weight_decay = 0.01;
  FusedAdamW adamw(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
  for (int64_t t = 1; t <= 40; ++t) {
    at::Tensor scale = torch::pow(10.0, torch::rand({n}, torch::kFloat64) * 13.0 - 12.0);
    at::Tensor g = torch::randn({n}, torch::kFloat64) * scale;
    g.masked_fill_(torch::rand({n}) < (t % 3 == 0 ? 0.7 : 0.1), 0.0);
    p.mutable_grad() = g;
    const at::Tensor before = p.detach().clone();
    adamw.step();
    const at::Tensor update = (before * (1.0 - lr * weight_decay) - p.detach()).abs().max();
    EXPECT_LE(update.item<double>(), lr * adam_update_bound(t, 0.9, 0.999) * (1.0 + 1e-9)) << "step " << t;
  }
}

// Two AdamW runs of one tensor from equal weights, the second's gradients `g + other(g)`.
at::Tensor adamw_run(const std::vector<at::Tensor>& gradients, const std::vector<at::Tensor>& added) {
  torch::manual_seed(3);
  at::Tensor p = (torch::randn({64, 64}) * 0.02).requires_grad_(true);
  FusedAdamW adamw(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(1e-3));
  for (size_t k = 0; k < gradients.size(); ++k) {
    p.mutable_grad() = gradients[k] + added[k];
    adamw.step();
  }
  return p.detach();
}

TEST(AfterAdamW, AcceptsRoundingAndRefusesALostGradient) {
  torch::manual_seed(11);
  std::vector<at::Tensor> gradients, rounding, zeros, lost;
  for (int k = 0; k < 3; ++k) {
    at::Tensor g = torch::randn({64, 64}) * 1e-3;
    g.view(-1).slice(0, 0, 40).mul_(1e-5);  // elements near eps, where rounding is amplified
    gradients.push_back(g);
    rounding.push_back(g * 1e-7 * torch::randn_like(g));
    zeros.push_back(torch::zeros_like(g));
    // A missing all-reduce: half the sum (another rank's partial product) is gone.
    lost.push_back(-0.5 * g + 0.5 * torch::randn_like(g) * 1e-3);
  }
  const at::Tensor reference = adamw_run(gradients, zeros);
  const AdamWSteps run{1e-3, 3};
  EXPECT_TRUE(agree_after_adamw(adamw_run(gradients, rounding), reference, run, 1e-3));
  EXPECT_FALSE(agree_after_adamw(adamw_run(gradients, lost), reference, run, 1e-3));
  // An element moved further than 3 steps can: refused even when the tensor as a whole agrees.
  at::Tensor jumped = reference.clone();
  jumped.view(-1)[5] += 1e-2;
  EXPECT_FALSE(agree_after_adamw(jumped, reference, run, 1.0));
  // One element differing by 1% of lr: 1e-5 / (3e-3 * 64) = 5e-5 of the update, accepted.
  at::Tensor nudged = reference.clone();
  nudged.view(-1)[7] += 1e-5;
  EXPECT_TRUE(agree_after_adamw(nudged, reference, run, 1e-3));
}

}  // namespace
}  // namespace harness::optim
