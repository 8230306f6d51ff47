// WithDevice: pins a module of a pipeline's Sequential to a device, whatever its parameters say
// (needed for parameterless modules, and to tell CPU lanes cpu:0 and cpu:1 apart).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <utility>

#include "harness/device.h"

namespace harness::pipeline {

class WithDeviceImpl : public torch::nn::Module {
 public:
  WithDeviceImpl(torch::nn::AnyModule module, Device device);
  // Any module holder or shared_ptr to a module with forward(Tensor) -> Tensor.
  template <typename ModuleType>
  WithDeviceImpl(ModuleType module, Device device)
      : WithDeviceImpl(torch::nn::AnyModule(std::move(module)), device) {}

  at::Tensor forward(const at::Tensor& x);

  const Device& device() const { return device_; }
  const torch::nn::AnyModule& module() const { return module_; }

 private:
  torch::nn::AnyModule module_;
  Device device_;
};
TORCH_MODULE(WithDevice);

}  // namespace harness::pipeline
