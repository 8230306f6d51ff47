// model::gelu_tanh against ATen's tanh GELU and against float64: forward and backward, float and
// bfloat16, a non-contiguous input, values from the far negative tail to the far positive one.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "harness/model/gelu.h"

namespace harness::model {
namespace {

struct Result {
  at::Tensor y, dx;
};

template <typename F>
Result run(F f, const at::Tensor& x, const at::Tensor& grad) {
  at::Tensor leaf = x.detach().requires_grad_(true);
  at::Tensor y = f(leaf);
  y.backward(grad);
  return {y.detach(), leaf.grad()};
}

at::Tensor inputs() {
  torch::manual_seed(5);
  // A normal spread, large magnitudes, the cut-off of the exp (|z| near 87 / 2) and exact zeros.
  return torch::cat({torch::randn({4096}) * 3, torch::linspace(-60, 60, 1201), torch::zeros({3})});
}

TEST(GeluTanh, FloatMatchesAtenAndFloat64) {
  const at::Tensor x = inputs(), grad = torch::randn_like(x);
  const Result ours = run(gelu_tanh, x, grad);
  const Result aten = run([](const at::Tensor& t) { return at::gelu(t, "tanh"); }, x, grad);
  const Result exact = run([](const at::Tensor& t) { return at::gelu(t, "tanh"); }, x.to(torch::kDouble),
                           grad.to(torch::kDouble));
  // Each within float rounding of the float64 result; ours no further from it than 2x ATen's error.
  const double y_error = (ours.y.to(torch::kDouble) - exact.y).abs().max().item<double>();
  const double dx_error = (ours.dx.to(torch::kDouble) - exact.dx).abs().max().item<double>();
  EXPECT_LT(y_error, 2e-6 * 60);
  EXPECT_LE(y_error, 2 * (aten.y.to(torch::kDouble) - exact.y).abs().max().item<double>() + 1e-7);
  EXPECT_LE(dx_error, 2 * (aten.dx.to(torch::kDouble) - exact.dx).abs().max().item<double>() + 1e-7);
  EXPECT_TRUE(torch::allclose(ours.y, aten.y, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(ours.dx, aten.dx, 1e-5, 1e-5));
  EXPECT_TRUE(torch::equal(ours.y.slice(0, -3), torch::zeros({3})));
  EXPECT_TRUE(torch::all(ours.y.isfinite()).item<bool>() && torch::all(ours.dx.isfinite()).item<bool>());
}

TEST(GeluTanh, Bfloat16AndNonContiguousInputs) {
  const at::Tensor x = inputs().to(torch::kBFloat16), grad = torch::randn(x.sizes()).to(torch::kBFloat16);
  const Result ours = run(gelu_tanh, x, grad);
  const Result aten = run([](const at::Tensor& t) { return at::gelu(t, "tanh"); }, x, grad);
  EXPECT_EQ(ours.y.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(ours.dx.scalar_type(), torch::kBFloat16);
  // Both compute in float and round once: at most one bfloat16 step apart.
  EXPECT_TRUE(torch::allclose(ours.y.to(torch::kFloat), aten.y.to(torch::kFloat), 8e-3, 1e-6));
  EXPECT_TRUE(torch::allclose(ours.dx.to(torch::kFloat), aten.dx.to(torch::kFloat), 8e-3, 1e-5));

  const at::Tensor m = torch::randn({64, 48}).t();  // a transposed view
  const Result strided = run(gelu_tanh, m, torch::ones_like(m));
  const Result reference = run([](const at::Tensor& t) { return at::gelu(t, "tanh"); }, m, torch::ones_like(m));
  EXPECT_TRUE(torch::allclose(strided.y, reference.y, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(strided.dx, reference.dx, 1e-5, 1e-5));
}

TEST(GeluTanh, OtherDtypesAreAtensOwn) {
  const at::Tensor x = torch::randn({100}, torch::kDouble);
  EXPECT_TRUE(torch::equal(gelu_tanh(x), at::gelu(x, "tanh")));
}

}  // namespace
}  // namespace harness::model
