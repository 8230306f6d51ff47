// split_module and WithDevice (a5_2_1).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "harness/pipeline/partition.h"
#include "harness/pipeline/with_device.h"

namespace harness::pipeline {
namespace {

TEST(SplitModule, a5_2_1_ThreeLayersOnTwoDevices) {
  torch::nn::Sequential model(WithDevice(torch::nn::Linear(4, 8), Device::cpu(0)),
                              WithDevice(torch::nn::Linear(8, 8), Device::cpu(0)),
                              WithDevice(torch::nn::Linear(8, 2), Device::cpu(1)));
  SplitModule split = split_module(model);
  ASSERT_EQ(split.partitions.size(), 2u);
  EXPECT_EQ(split.devices, (std::vector<Device>{Device::cpu(0), Device::cpu(1)}));
  EXPECT_EQ(split.partitions[0]->size(), 2u);
  EXPECT_EQ(split.partitions[1]->size(), 1u);
  // The partitions hold the very same modules: running them in turn is running the model.
  const auto x = torch::randn({3, 4});
  EXPECT_TRUE(torch::equal(split.partitions[1]->forward(split.partitions[0]->forward(x)),
                           model->forward(x)));
}

TEST(SplitModule, a5_2_1_ParameterlessLayerPinnedByWithDevice) {
  torch::nn::Sequential model(WithDevice(torch::nn::Linear(4, 4), Device::cpu(0)),
                              WithDevice(torch::nn::ReLU(), Device::cpu(1)),
                              WithDevice(torch::nn::Linear(4, 4), Device::cpu(1)));
  const SplitModule split = split_module(model);
  ASSERT_EQ(split.partitions.size(), 2u);
  EXPECT_EQ(split.devices, (std::vector<Device>{Device::cpu(0), Device::cpu(1)}));
  EXPECT_EQ(split.partitions[1]->size(), 2u);
}

TEST(SplitModule, UnpinnedModulesFollowTheirParametersElseCpu) {
  // Parameterless: cpu:0; CPU parameters: cpu:0; so all three form one partition.
  torch::nn::Sequential model(torch::nn::Linear(2, 2), torch::nn::Sigmoid(), torch::nn::Linear(2, 2));
  const SplitModule split = split_module(model);
  ASSERT_EQ(split.partitions.size(), 1u);
  EXPECT_EQ(split.devices[0], Device::cpu(0));
  EXPECT_EQ(split.partitions[0]->size(), 3u);
}

// In C++ a Sequential nests inside another only through a subclass with a concrete forward.
struct StageImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Stage);

TEST(SplitModule, NestedSequentialsAreFlattened) {
  Stage inner(WithDevice(torch::nn::Linear(2, 2), Device::cpu(0)),
                              WithDevice(torch::nn::Linear(2, 2), Device::cpu(1)));
  torch::nn::Sequential model(WithDevice(torch::nn::Linear(2, 2), Device::cpu(0)), inner,
                              WithDevice(torch::nn::Linear(2, 2), Device::cpu(0)));
  const SplitModule split = split_module(model);
  EXPECT_EQ(split.devices,
            (std::vector<Device>{Device::cpu(0), Device::cpu(1), Device::cpu(0)}));
  EXPECT_EQ(split.partitions[0]->size(), 2u);
  EXPECT_EQ(split.partitions[1]->size(), 1u);
  EXPECT_EQ(split.partitions[2]->size(), 1u);
}

// A meta-device parameter stands in for a second GPU, so this runs without one.
struct MixedImpl : torch::nn::Module {
  MixedImpl() {
    register_parameter("host_weight", torch::ones({2, 2}));
    register_parameter("other_weight", torch::empty({2, 2}, torch::Device(torch::kMeta)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};
TORCH_MODULE(Mixed);

TEST(SplitModule, MixedDeviceModuleIsRejectedWithItsName) {
  torch::nn::Sequential model(torch::nn::Linear(2, 2), Mixed());
  try {
    split_module(model);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("child 1"), std::string::npos) << message;
    EXPECT_NE(message.find("host_weight on cpu"), std::string::npos) << message;
    EXPECT_NE(message.find("other_weight on meta"), std::string::npos) << message;
  }
}

TEST(SplitModule, RejectsAnEmptySequential) {
  EXPECT_THROW(split_module(torch::nn::Sequential()), std::invalid_argument);
}

}  // namespace
}  // namespace harness::pipeline
