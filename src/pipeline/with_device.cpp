// WithDevice passes its input straight to the wrapped module.
#include "harness/pipeline/with_device.h"

#include <torch/torch.h>

namespace harness::pipeline {

WithDeviceImpl::WithDeviceImpl(torch::nn::AnyModule module, Device device)
    : module_(std::move(module)), device_(device) {
  TORCH_CHECK(!module_.is_empty(), "WithDevice(", device_.str(), "): the wrapped module is empty");
  register_module("module", module_.ptr());
}

at::Tensor WithDeviceImpl::forward(const at::Tensor& x) { return module_.forward(x); }

}  // namespace harness::pipeline
