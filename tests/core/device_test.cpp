// Device names and lists.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <c10/core/Device.h>
#include <torch/cuda.h>

#include <algorithm>
#include <future>
#include <thread>

#include "harness/device.h"

namespace harness {
namespace {

TEST(Device, ParsesCpuLanesAndCuda) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu(0));
  EXPECT_EQ(Device::parse("cpu:3"), Device::cpu(3));
  EXPECT_EQ(Device::parse("cuda:1"), Device::cuda(1));
  EXPECT_EQ(Device::parse("cpu:2").str(), "cpu:2");
  EXPECT_TRUE(Device::parse("cpu:1").torch_device().is_cpu());
}

TEST(Device, RejectsMalformedNames) {
  EXPECT_THROW(Device::parse("tpu:0"), std::invalid_argument);
  EXPECT_THROW(Device::parse("cpu:x"), std::invalid_argument);
  EXPECT_THROW(Device::parse("cpu:"), std::invalid_argument);
}

TEST(Device, TheDeviceFlagParsesAndOnlyCudaOrAutoWithAGpuUsesGpus) {
  EXPECT_EQ(parse_device_choice("auto"), DeviceChoice::kAuto);
  EXPECT_EQ(parse_device_choice("cpu"), DeviceChoice::kCpu);
  EXPECT_EQ(parse_device_choice("cuda"), DeviceChoice::kCuda);
  try {
    parse_device_choice("tpu");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--device 'tpu'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(uses_gpus(DeviceChoice::kCpu));
  EXPECT_TRUE(uses_gpus(DeviceChoice::kCuda));
  EXPECT_EQ(uses_gpus(DeviceChoice::kAuto), torch::cuda::is_available());
}

TEST(Device, ListRejectsDuplicatesAndMissingGpus) {
  EXPECT_EQ(parse_device_list("cpu:0,cpu:1").size(), 2u);
  EXPECT_THROW(parse_device_list("cpu:0,cpu:0"), std::invalid_argument);
  EXPECT_THROW(parse_device_list("cuda:99"), std::invalid_argument);
  EXPECT_THROW(parse_device_list(""), std::invalid_argument);
}

TEST(Device, DefaultThreadsShareTheCores) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(default_threads_per_device(1), cores);
  EXPECT_EQ(default_threads_per_device(2), std::max(1, cores / 2));
  EXPECT_EQ(default_threads_per_device(3), std::max(1, cores / 3));
  EXPECT_EQ(default_threads_per_device(0), cores) << "no devices counts as one";
  EXPECT_EQ(default_threads_per_device(100000), 1) << "never below one thread";
}

TEST(Device, FromTorchMapsEveryCpuTensorToLaneZero) {
  EXPECT_EQ(Device::from_torch(c10::Device(c10::kCPU)), Device::cpu(0));
  EXPECT_EQ(Device::from_torch(c10::Device(c10::kCUDA, 1)), Device::cuda(1));
  EXPECT_EQ(Device::from_torch(c10::Device(c10::kCUDA)), Device::cuda(0));
}

TEST(Device, LaneWidthIsPerThread) {
  // Lane a keeps its own intra-op width after lane b set another one on its own thread. (The
  // width is what ATen's OpenMP kernels use: the thread's omp_get_max_threads().)
  std::promise<void> a_entered, b_entered;
  int width_a = 0, width_b = 0;
  std::thread a([&] {
    enter_device_lane(Device::cpu(0), 1);
    a_entered.set_value();
    b_entered.get_future().wait();
    width_a = at::get_num_threads();
  });
  std::thread b([&] {
    a_entered.get_future().wait();
    enter_device_lane(Device::cpu(1), 3);
    width_b = at::get_num_threads();
    b_entered.set_value();
  });
  a.join();
  b.join();
  EXPECT_EQ(width_a, 1);
  EXPECT_EQ(width_b, 3);
  EXPECT_THROW(enter_device_lane(Device::cpu(0), 0), std::invalid_argument);
}

}  // namespace
}  // namespace harness
