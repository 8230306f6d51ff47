// Checkpoint state outside the weights: AdamW's state survives capture, a file and restore
// exactly (the next step is bit-identical), generator states replay the same draws.
#include "harness/train/checkpoint/training_state.h"

#include "harness/train/step/train_step.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>

namespace harness::train {
namespace {

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(6, 4));
    out = register_module("out", torch::nn::Linear(4, 2));
  }
  at::Tensor forward(const at::Tensor& x) { return out(torch::tanh(fc(x))); }
  torch::nn::Linear fc{nullptr}, out{nullptr};
};

void train_steps(Net& net, torch::optim::AdamW& optimizer, int steps, uint64_t data_seed) {
  torch::manual_seed(data_seed);
  for (int i = 0; i < steps; ++i) {
    const at::Tensor x = torch::randn({5, 6});
    optimizer.zero_grad();
    net.forward(x).pow(2).sum().backward();
    optimizer.step();
  }
}

void copy_weights(Net& from, Net& to) {
  torch::NoGradGuard no_grad;
  auto a = from.named_parameters();
  for (auto& item : to.named_parameters()) item.value().copy_(a[item.key()]);
}

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          (name + "_" + std::to_string(::getpid()) + ".safetensors")).string();
}

TEST(TrainingStateTest, AdamWStateThroughAFileContinuesBitIdentically) {
  torch::manual_seed(1);
  Net a;
  torch::optim::AdamW opt_a(a.parameters(), torch::optim::AdamWOptions(1e-2));
  train_steps(a, opt_a, 3, 10);

  const OptimizerState captured = capture_adamw_state(opt_a, named_parameters_of(a));
  ASSERT_EQ(captured.size(), 4u);
  EXPECT_EQ(captured.at("fc.weight").step, 3);
  const std::string path = temp_file("adamw_state");
  write_optimizer_state(path, captured);
  const OptimizerState read = read_optimizer_state(path);
  ::unlink(path.c_str());
  ASSERT_EQ(read.size(), captured.size());
  for (const auto& [name, s] : captured) {
    EXPECT_EQ(read.at(name).step, s.step) << name;
    EXPECT_TRUE(torch::equal(read.at(name).exp_avg, s.exp_avg)) << name;
    EXPECT_TRUE(torch::equal(read.at(name).exp_avg_sq, s.exp_avg_sq)) << name;
  }

  torch::manual_seed(99);
  Net b;
  copy_weights(a, b);
  torch::optim::AdamW opt_b(b.parameters(), torch::optim::AdamWOptions(1e-2));
  restore_adamw_state(opt_b, named_parameters_of(b), read);
  train_steps(a, opt_a, 2, 11);
  train_steps(b, opt_b, 2, 11);
  auto pa = a.named_parameters();
  for (const auto& item : b.named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), pa[item.key()])) << item.key();
  }

  // Without the state the same steps diverge: the test above could fail.
  Net c;
  copy_weights(a, c);
  torch::optim::AdamW opt_c(c.parameters(), torch::optim::AdamWOptions(1e-2));
  train_steps(a, opt_a, 1, 12);
  train_steps(c, opt_c, 1, 12);
  EXPECT_FALSE(torch::equal(c.fc->weight, a.fc->weight));
}

TEST(TrainingStateTest, RestoreRefusesUnknownNamesAndOtherShapes) {
  Net net;
  torch::optim::AdamW optimizer(net.parameters(), torch::optim::AdamWOptions(1e-2));
  OptimizerState state;
  state["fc.nope"] = {1, torch::zeros({4, 6}), torch::zeros({4, 6})};
  try {
    restore_adamw_state(optimizer, named_parameters_of(net), state);
    FAIL() << "accepted a state for an unknown parameter";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fc.nope"), std::string::npos) << e.what();
  }
  state.clear();
  state["fc.weight"] = {1, torch::zeros({6, 4}), torch::zeros({6, 4})};
  try {
    restore_adamw_state(optimizer, named_parameters_of(net), state);
    FAIL() << "accepted a transposed state";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[6, 4]"), std::string::npos) << e.what();
  }
}

TEST(TrainingStateTest, GeneratorStatesReplayTheSameDraws) {
  torch::manual_seed(5);
  (void)torch::rand({3});
  const GeneratorStates states = capture_generator_states({c10::Device(c10::kCPU)});
  ASSERT_EQ(states.size(), 1u);
  ASSERT_EQ(states.count("cpu"), 1u);
  const at::Tensor first = torch::rand({8});
  const at::Tensor mask = torch::dropout(torch::ones({64}), 0.5, true);
  restore_generator_states(states);
  EXPECT_TRUE(torch::equal(torch::rand({8}), first));
  EXPECT_TRUE(torch::equal(torch::dropout(torch::ones({64}), 0.5, true), mask));
  EXPECT_THROW(restore_generator_states({{"cuda:7", states.at("cpu")}}), std::runtime_error);
}

TEST(TrainingStateTest, HexRoundTripAndErrors) {
  const std::string bytes("\x00\x01\xfe\xff", 4);
  EXPECT_EQ(to_hex(bytes), "0001feff");
  EXPECT_EQ(from_hex("0001feff", "x"), bytes);
  EXPECT_THROW(from_hex("abc", "x"), std::runtime_error);
  EXPECT_THROW(from_hex("zz", "x"), std::runtime_error);
}

}  // namespace
}  // namespace harness::train
