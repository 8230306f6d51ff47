// Two runs that should train alike (two layouts, a run and its resume), compared after AdamW
// steps, by what AdamW guarantees on any processor and BLAS.
//
// The runs' gradients agree to rounding (about 1e-7 relative): they sum in different orders, and
// the BLAS kernels differ between processors. Compare those tightly, before any step. AdamW then
// divides each gradient by its own running RMS, so an element whose gradient is near eps (or zero
// in exact arithmetic, as the key third of c_attn.bias) turns a rounding difference into a step
// difference of a sizeable fraction of lr. After the steps two things remain guaranteed:
//  - each tensor as a whole agrees, since such elements are few: ||a - b|| is a small fraction of
//    the update the steps make to it, about lr per element and step, so of lr * steps * sqrt(n).
//    (Against ||b|| instead, one such element of a small tensor, differing by 1% of lr, already
//    comes near 1e-5 at lr 1e-3, and ten times that at lr 1e-2: the weights' size is not the scale
//    of what rounding moves.)
//  - no element differs by more than AdamW can move it. With moments m_t = sum_i w_i g_i and
//    v_t = sum_i u_i g_i^2 (the bias-corrected weights w_i = (1-b1) b1^(t-i) / (1-b1^t) and
//    u_i = (1-b2) b2^(t-i) / (1-b2^t)), Cauchy-Schwarz gives |m_t| <= R_t sqrt(v_t) with
//    R_t = sqrt(sum_i w_i^2 / u_i), whatever the gradients, so an update is at most lr R_t
//    (R_1 = 1, R_t ~ 1.0 for the first steps at b = (0.9, 0.999)). Decoupled weight decay only
//    shrinks a difference, so after k steps from equal weights |a - b| <= 2 lr sum_{t<=k} R_t.
// A real bug (a missing all-reduce, a stage's gradient dropped) turns the direction of the whole
// update: ||a - b|| comes near the update's own size, far outside both.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>

namespace harness::test_support {

// The AdamW steps both runs took.
struct AdamWSteps {
  double lr = 0.0;
  int64_t steps = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
};

// R_t above: the largest |m_t| / sqrt(v_t) of step t (1-based) for any gradients.
inline double adam_update_bound(int64_t t, double beta1, double beta2) {
  const double c1 = 1.0 - std::pow(beta1, static_cast<double>(t));
  const double c2 = 1.0 - std::pow(beta2, static_cast<double>(t));
  double sum = 0.0;
  for (int64_t i = 1; i <= t; ++i) {
    const double w = (1.0 - beta1) * std::pow(beta1, static_cast<double>(t - i)) / c1;
    const double u = (1.0 - beta2) * std::pow(beta2, static_cast<double>(t - i)) / c2;
    sum += w * w / u;
  }
  return std::sqrt(sum);
}

// The largest element-wise difference two AdamW runs from equal weights can reach.
inline double adamw_drift_bound(const AdamWSteps& run) {
  double bound = 0.0;
  for (int64_t t = 1; t <= run.steps; ++t) bound += 2.0 * run.lr * adam_update_bound(t, run.beta1, run.beta2);
  return bound;
}

// The size of the update `run` makes to a tensor of `numel` elements, AdamW stepping each element
// by about lr: lr * steps * sqrt(numel).
inline double nominal_update_norm(const AdamWSteps& run, int64_t numel) {
  return run.lr * static_cast<double>(run.steps) * std::sqrt(static_cast<double>(numel));
}

// Gradients of the first step, before AdamW: every element within `tolerance` of the tensor's
// largest (sums in another order differ in the last bits, relative to the terms summed).
inline ::testing::AssertionResult gradients_agree(const at::Tensor& actual, const at::Tensor& expected,
                                                  double tolerance = 1e-5) {
  if (!actual.sizes().equals(expected.sizes())) {
    return ::testing::AssertionFailure() << "shape " << actual.sizes() << " against " << expected.sizes();
  }
  const double scale = expected.abs().max().item<double>();
  const double worst = (actual.to(torch::kFloat64) - expected.to(torch::kFloat64)).abs().max().item<double>();
  if (worst <= tolerance * scale + 1e-10) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "largest difference " << worst << " against " << tolerance << " of the "
                                       << "largest element " << scale;
}

// One tensor after `run`: ||a - b|| within `update_fraction` of the nominal update, every element
// within the drift bound. `update_fraction` < 0 checks the element-wise bound alone.
inline ::testing::AssertionResult agree_after_adamw(const at::Tensor& actual, const at::Tensor& expected,
                                                    const AdamWSteps& run, double update_fraction) {
  if (!actual.sizes().equals(expected.sizes())) {
    return ::testing::AssertionFailure() << "shape " << actual.sizes() << " against " << expected.sizes();
  }
  const double bound = adamw_drift_bound(run);
  const at::Tensor difference = actual.to(torch::kFloat64) - expected.to(torch::kFloat64);
  const double worst = difference.abs().max().item<double>();
  const double whole = difference.norm().item<double>();
  const double update = nominal_update_norm(run, expected.numel());
  std::ostringstream why;
  if (worst > bound) {
    why << "an element differs by " << worst << ", more than " << run.steps << " AdamW steps of lr " << run.lr
        << " can move it (" << bound << "); ";
  }
  if (update_fraction >= 0.0 && whole > update_fraction * update) {
    why << "||a - b|| = " << whole << " is " << whole / update << " of the update lr * steps * sqrt(n) = " << update
        << " (at most " << update_fraction << ")";
  }
  if (why.str().empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << why.str();
}

// Every weight of `expected` in `actual`, by agree_after_adamw. The key third of each c_attn.bias
// (rows n_embd..2 n_embd) gets a zero gradient in exact arithmetic (it adds q_i . b_k to every score
// of query i, which softmax ignores), so it holds AdamW-scaled rounding noise that differs between
// runs: it is held to the element-wise bound only; its query and value thirds compare as any weight.
inline void expect_weights_agree_after_adamw(const std::map<std::string, at::Tensor>& actual,
                                             const std::map<std::string, at::Tensor>& expected, int64_t n_embd,
                                             const AdamWSteps& run, double update_fraction, const std::string& label) {
  EXPECT_EQ(actual.size(), expected.size()) << label;
  const int64_t C = n_embd;
  for (const auto& [name, weight] : expected) {
    ASSERT_TRUE(actual.count(name)) << label << ": no weight " << name;
    const at::Tensor& mine = actual.at(name);
    const bool qkv_bias = name.size() >= 16 && name.compare(name.size() - 16, 16, "attn.c_attn.bias") == 0;
    if (qkv_bias && weight.dim() == 1 && weight.size(0) == 3 * C) {
      EXPECT_TRUE(agree_after_adamw(mine.slice(0, C, 2 * C), weight.slice(0, C, 2 * C), run, -1.0))
          << label << ": " << name << " key third";
      EXPECT_TRUE(agree_after_adamw(torch::cat({mine.slice(0, 0, C), mine.slice(0, 2 * C)}),
                                    torch::cat({weight.slice(0, 0, C), weight.slice(0, 2 * C)}), run, update_fraction))
          << label << ": " << name << " query and value thirds";
      continue;
    }
    EXPECT_TRUE(agree_after_adamw(mine, weight, run, update_fraction)) << label << ": " << name;
  }
}

}  // namespace harness::test_support
