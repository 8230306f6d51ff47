// Checkpoint state on GPUs: the default CUDA generators' states are captured by device name and
// restored so that the same draws (torch::rand, dropout masks) come again; AdamW's state of CUDA
// parameters goes to the CPU and back so that the next step is bit-identical.
#include "harness/train/checkpoint/training_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace harness::train {
namespace {

NamedParameters parameters_of(torch::nn::Module& module) {
  NamedParameters out;
  for (const auto& p : module.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

std::vector<c10::Device> every_gpu() {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (int i = 0; i < cuda_testing::gpu_count(); ++i) devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
  return devices;
}

TEST(CudaTrainingState, GeneratorStatesOfEveryGpuReplayTheSameDraws) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  torch::manual_seed(5);
  const std::vector<c10::Device> devices = every_gpu();
  for (const auto& d : devices) (void)torch::rand({3}, torch::TensorOptions().device(d));  // move the streams on
  const GeneratorStates states = capture_generator_states(devices);
  ASSERT_EQ(states.size(), devices.size());
  ASSERT_EQ(states.count("cuda:0"), 1u);

  auto draws = [&] {
    std::vector<at::Tensor> out;
    for (const auto& d : devices) {
      const auto options = torch::TensorOptions().device(d);
      out.push_back(torch::rand({1000}, options).cpu());
      out.push_back(torch::dropout(torch::ones({4096}, options), 0.5, /*train=*/true).cpu());
      out.push_back(torch::randn({257}, options).cpu());
    }
    return out;
  };
  const std::vector<at::Tensor> first = draws();
  const std::vector<at::Tensor> moved_on = draws();
  EXPECT_FALSE(torch::equal(first[0], moved_on[0]));  // the streams did move: the check below can fail
  restore_generator_states(states);
  const std::vector<at::Tensor> again = draws();
  ASSERT_EQ(again.size(), first.size());
  for (size_t k = 0; k < first.size(); ++k) {
    EXPECT_TRUE(torch::equal(again[k], first[k])) << "draw " << k << " (device " << devices[k / 3].str() << ")";
  }
  // A state for a GPU this process does not have is refused, naming it.
  const std::string absent = "cuda:" + std::to_string(cuda_testing::gpu_count());
  EXPECT_THROW(restore_generator_states({{absent, states.at("cuda:0")}}), std::runtime_error);
}

TEST(CudaTrainingState, AdamWStateOfCudaParametersRoundTripsBitIdentically) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(1);
  torch::nn::Linear a(6, 4), b(6, 4);
  a->to(cuda);
  b->to(cuda);
  torch::optim::AdamW opt_a(a->parameters(), torch::optim::AdamWOptions(1e-2));
  auto steps = [&](torch::nn::Linear& net, torch::optim::AdamW& opt, int count, uint64_t seed) {
    torch::manual_seed(seed);
    for (int i = 0; i < count; ++i) {
      const at::Tensor x = torch::randn({5, 6}).to(cuda);
      opt.zero_grad();
      net->forward(x).pow(2).sum().backward();
      opt.step();
    }
  };
  steps(a, opt_a, 3, 10);
  const OptimizerState state = capture_adamw_state(opt_a, parameters_of(*a));
  ASSERT_EQ(state.size(), 2u);
  for (const auto& [name, s] : state) {
    EXPECT_TRUE(s.exp_avg.device().is_cpu()) << name;
    EXPECT_EQ(s.step, 3) << name;
  }
  {
    torch::NoGradGuard no_grad;
    b->weight.copy_(a->weight);
    b->bias.copy_(a->bias);
  }
  torch::optim::AdamW opt_b(b->parameters(), torch::optim::AdamWOptions(1e-2));
  restore_adamw_state(opt_b, parameters_of(*b), state);
  steps(a, opt_a, 2, 11);
  steps(b, opt_b, 2, 11);
  EXPECT_TRUE(torch::equal(a->weight.cpu(), b->weight.cpu()));
  EXPECT_TRUE(torch::equal(a->bias.cpu(), b->bias.cpu()));
}

}  // namespace
}  // namespace harness::train
