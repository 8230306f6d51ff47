// Splitting a Sequential into per-device partitions (SPEC §6 split_module).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <vector>

#include "harness/device.h"

namespace harness::pipeline {

struct SplitModule {
  std::vector<torch::nn::Sequential> partitions;
  std::vector<Device> devices;  // devices[j] runs partitions[j]
};

// Walks the children in order (nested Sequentials flattened). A child's device is its WithDevice
// device (the wrapped module is moved there), else the device of its parameters (all must agree;
// any CPU tensor means cpu:0), else cpu:0. Consecutive children on the same device form one
// partition. Throws std::invalid_argument naming the child when its parameters disagree, and
// when the Sequential is empty.
SplitModule split_module(const torch::nn::Sequential& module);

}  // namespace harness::pipeline
