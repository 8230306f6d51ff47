// FusedAdamW against torch::optim::AdamW: the same trajectory to rounding, the same state (so
// checkpoints keep working), ZeRO's flat update equal to the per-parameter one, refusals.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/optim/fused_adamw.h"

namespace harness::optim {
namespace {

std::vector<at::Tensor> parameters(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({7, 5}).requires_grad_(true), torch::randn({5}).requires_grad_(true),
          torch::randn({3, 4, 2}).requires_grad_(true)};
}

void fill_gradients(std::vector<at::Tensor>& ps, int step) {
  torch::manual_seed(100 + step);
  for (auto& p : ps) p.mutable_grad() = torch::randn_like(p);
}

TEST(FusedAdamW, FollowsTorchAdamWToRoundingAndKeepsItsState) {
  auto want = parameters(1), got = parameters(1);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.8, 0.99}).eps(1e-6);
  torch::optim::AdamW reference(want, options);
  FusedAdamW fused(got, options);
  for (int step = 0; step < 5; ++step) {
    fill_gradients(want, step);
    fill_gradients(got, step);
    reference.step();
    fused.step();
  }
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-6, 1e-7)) << i << ": " << (got[i] - want[i]).abs().max();
    const auto& r = static_cast<torch::optim::AdamWParamState&>(*reference.state().at(want[i].unsafeGetTensorImpl()));
    const auto& f = static_cast<torch::optim::AdamWParamState&>(*fused.state().at(got[i].unsafeGetTensorImpl()));
    EXPECT_EQ(f.step(), 5);
    EXPECT_TRUE(torch::allclose(f.exp_avg(), r.exp_avg(), 1e-6, 1e-7));
    EXPECT_TRUE(torch::allclose(f.exp_avg_sq(), r.exp_avg_sq(), 1e-6, 1e-9));
  }
  // A parameter without a gradient is left alone and gets no state.
  auto extra = parameters(2);
  FusedAdamW partial(extra, options);
  extra[0].mutable_grad() = torch::ones_like(extra[0]);
  const at::Tensor before = extra[1].detach().clone();
  partial.step();
  EXPECT_TRUE(torch::equal(extra[1], before));
  EXPECT_EQ(partial.state().count(extra[1].unsafeGetTensorImpl()), 0u);
  EXPECT_EQ(partial.state().count(extra[0].unsafeGetTensorImpl()), 1u);
}

TEST(FusedAdamW, FlatUpdateEqualsThePerParameterStep) {
  auto ps = parameters(3);
  FusedAdamW fused(ps, torch::optim::AdamWOptions(1e-3));
  std::vector<at::Tensor> flat_parts;
  for (const auto& p : ps) flat_parts.push_back(p.detach().reshape({-1}));
  at::Tensor flat = torch::cat(flat_parts);
  at::Tensor m = torch::zeros_like(flat), v = torch::zeros_like(flat);
  AdamWHyperparameters h;
  h.lr = 1e-3;
  for (int step = 1; step <= 3; ++step) {
    fill_gradients(ps, step);
    std::vector<at::Tensor> grads;
    for (const auto& p : ps) grads.push_back(p.grad().reshape({-1}));
    fused.step();
    fused_adamw_update({flat}, {torch::cat(grads)}, {m}, {v}, step, h);
  }
  std::vector<at::Tensor> after;
  for (const auto& p : ps) after.push_back(p.detach().reshape({-1}));
  EXPECT_TRUE(torch::equal(torch::cat(after), flat));
}

TEST(FusedAdamW, RefusesAmsgrad) {
  auto ps = parameters(4);
  FusedAdamW fused(ps, torch::optim::AdamWOptions(1e-3).amsgrad(true));
  fill_gradients(ps, 0);
  EXPECT_THROW(fused.step(), std::invalid_argument);
}

}  // namespace
}  // namespace harness::optim
