// ShardedUnits (ZeRO-3's units) on one rank: the gradients its reduce-scatters leave in the
// chunks, and the unit-sized buffers it takes again from its pool instead of allocating them
// anew every step. The averaged steps over several ranks are test_zero3.py's.
#include "harness/zero/sharded_units.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_support.h"

namespace harness::data_parallel {
namespace {

using testing::one_rank;
using zero::ShardedUnit;
using zero::ShardedUnits;

ShardedUnit unit_of(const std::string& name, std::vector<at::Tensor> parameters) {
  ShardedUnit unit;
  unit.name = name;
  for (size_t k = 0; k < parameters.size(); ++k) unit.names.push_back(name + "." + std::to_string(k));
  unit.parameters = std::move(parameters);
  unit.accumulations.assign(unit.parameters.size(), 1);
  return unit;
}

TEST(ShardedUnits, StepsTakeTheirBuffersFromThePoolAndLeaveTheGradientsInTheChunks) {
  const DistContext ctx = one_rank();
  torch::manual_seed(5);
  // Two units of one size (as GPT-2's blocks) and a larger one (the embeddings).
  std::vector<at::Tensor> a{torch::randn({64, 32}).requires_grad_(), torch::randn({32}).requires_grad_()};
  std::vector<at::Tensor> b{torch::randn({64, 32}).requires_grad_(), torch::randn({32}).requires_grad_()};
  std::vector<at::Tensor> c{torch::randn({256, 32}).requires_grad_()};
  const std::vector<at::Tensor> values{a[0].detach().clone(), a[1].detach().clone(), b[0].detach().clone(),
                                       b[1].detach().clone(), c[0].detach().clone()};
  std::vector<ShardedUnit> specs{unit_of("a", a), unit_of("b", b), unit_of("c", c)};
  ShardedUnits units(ctx, std::move(specs));
  EXPECT_EQ(units.live_bytes(), 0);
  EXPECT_FALSE(a[0].storage().data()) << "the full parameters are let go once sharded";

  const at::Tensor x = torch::randn({3, 64});
  std::vector<int64_t> held_after_step;
  for (int step = 0; step < 10; ++step) {
    units.discard_gradients();
    // Forward: each unit gathered right before its use and let go after; backward regathers
    // them in reverse (as zero3_step.h's hooks do).
    units.wait(0);
    const at::Tensor h = torch::tanh(torch::mm(x, a[0]) + a[1]);
    units.release(0);
    units.wait(1);
    const at::Tensor k = h.unsqueeze(2) * b[0].narrow(0, 0, 32).unsqueeze(0) + b[1];
    units.release(1);
    units.wait(2);
    const at::Tensor loss = (k.sum(1).matmul(c[0].t())).square().mean();
    units.wait(1);
    units.wait(0);
    loss.backward();
    units.finalize();
    EXPECT_EQ(units.live_bytes(), 0) << "every unit let go once its gradients are reduced, step " << step;
    held_after_step.push_back(units.pooled_bytes());
  }
  // Taken again, not allocated anew: what each step gives back stays below what one step can
  // hold at once (of each size: two units gathered, a send buffer, and two reduce-scatters in
  // flight with two buffers each), where ten steps' worth would be over it.
  const int64_t block = units.full_bytes(0), embeddings = units.full_bytes(2);
  ASSERT_EQ(units.full_bytes(1), block);
  EXPECT_GT(held_after_step.front(), 0);
  for (size_t step = 0; step < held_after_step.size(); ++step) {
    EXPECT_LE(held_after_step[step], 7 * block + 3 * embeddings) << "step " << step;
  }

  // The last step's gradients, by plain autograd on the unsharded values, are in the chunks.
  std::vector<at::Tensor> p;
  for (const at::Tensor& v : values) p.push_back(v.clone().requires_grad_());
  const at::Tensor h = torch::tanh(torch::mm(x, p[0]) + p[1]);
  const at::Tensor k = h.unsqueeze(2) * p[2].narrow(0, 0, 32).unsqueeze(0) + p[3];
  (k.sum(1).matmul(p[4].t())).square().mean().backward();
  const std::vector<std::vector<size_t>> of_unit{{0, 1}, {2, 3}, {4}};
  for (size_t u = 0; u < 3; ++u) {
    std::vector<at::Tensor> gradients, weights;
    for (size_t j : of_unit[u]) {
      gradients.push_back(p[j].grad().reshape({-1}));
      weights.push_back(values[j].reshape({-1}));
    }
    EXPECT_TRUE(torch::allclose(units.gradient_chunk(u), torch::cat(gradients), 1e-6, 1e-6)) << "unit " << u;
    EXPECT_TRUE(units.weight_chunk(u).equal(torch::cat(weights))) << "unit " << u;
  }
}

}  // namespace
}  // namespace harness::data_parallel
