// The model-parallel random stream: different per rank inside, the default generator untouched
// outside.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/tensor_parallel/parallel_rng.h"

namespace harness::tensor_parallel {
namespace {

const c10::Device kCpu(c10::kCPU);

at::Tensor draw() { return torch::rand({6}); }

TEST(ParallelRegionRng, RanksDrawDifferentNumbersAndLeaveTheDefaultGeneratorInStep) {
  torch::manual_seed(42);
  ParallelRegionRng rank0(0), rank1(1);
  at::Generator cpu = at::globalContext().defaultGenerator(kCpu);
  // The first use of each seeds its stream with one draw of the default generator: the same draw
  // for both ranks when each starts from the same state.
  const at::Tensor start = cpu.get_state();
  const at::Tensor a0 = rank0.run(kCpu, draw);
  const at::Tensor after_seeding = cpu.get_state();
  cpu.set_state(start);
  const at::Tensor a1 = rank1.run(kCpu, draw);
  EXPECT_TRUE(torch::equal(cpu.get_state(), after_seeding));
  EXPECT_FALSE(torch::equal(a0, a1)) << "ranks must draw independent masks";

  // From then on run() leaves the default generator exactly as it found it.
  const at::Tensor before = cpu.get_state();
  const at::Tensor b0 = rank0.run(kCpu, draw);
  EXPECT_TRUE(torch::equal(cpu.get_state(), before));
  EXPECT_FALSE(torch::equal(a0, b0)) << "the stream continues from call to call";

  // The same rank from the same seed reproduces its stream.
  torch::manual_seed(42);
  ParallelRegionRng again(0);
  EXPECT_TRUE(torch::equal(again.run(kCpu, draw), a0));
  EXPECT_TRUE(torch::equal(again.run(kCpu, draw), b0));
}

TEST(ParallelRegionRng, RestoresTheDefaultGeneratorWhenTheFunctionThrows) {
  torch::manual_seed(7);
  ParallelRegionRng rng(0);
  rng.run(kCpu, draw);
  at::Generator cpu = at::globalContext().defaultGenerator(kCpu);
  const at::Tensor before = cpu.get_state();
  EXPECT_THROW(rng.run(kCpu, []() -> at::Tensor {
    torch::rand({3});
    throw std::runtime_error("boom");
  }), std::runtime_error);
  EXPECT_TRUE(torch::equal(cpu.get_state(), before));
}

}  // namespace
}  // namespace harness::tensor_parallel
