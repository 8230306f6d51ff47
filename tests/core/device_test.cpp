// Device names and lists.
#include <gtest/gtest.h>

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

TEST(Device, ListRejectsDuplicatesAndMissingGpus) {
  EXPECT_EQ(parse_device_list("cpu:0,cpu:1").size(), 2u);
  EXPECT_THROW(parse_device_list("cpu:0,cpu:0"), std::invalid_argument);
  EXPECT_THROW(parse_device_list("cuda:99"), std::invalid_argument);
  EXPECT_THROW(parse_device_list(""), std::invalid_argument);
}

TEST(Device, DefaultThreadsShareTheCores) {
  EXPECT_GE(default_threads_per_device(2), 1);
  EXPECT_EQ(default_threads_per_device(100000), 1);
}

}  // namespace
}  // namespace harness
