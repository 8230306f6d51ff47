// split_module: a Sequential cut into runs of consecutive children on the same device.
#include "harness/pipeline/partition.h"

#include <torch/torch.h>

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>

#include "harness/pipeline/with_device.h"

namespace harness::pipeline {
namespace {

struct Child {
  std::string path;  // "2" or "2.1" for a child of a nested Sequential
  torch::nn::AnyModule module;
  Device device;
};

Device device_of_parameters(torch::nn::Module& module, const std::string& path) {
  std::set<std::string> devices;  // torch device names: "cpu", "cuda:1", ...
  std::string listing;
  c10::Device device = c10::kCPU;
  for (const auto& named : module.named_parameters(/*recurse=*/true)) {
    device = named.value().device();
    if (devices.insert(device.str()).second) {
      listing += (listing.empty() ? "" : ", ") + named.key() + " on " + device.str();
    }
  }
  if (devices.empty()) return Device::cpu(0);
  if (devices.size() > 1) {
    throw std::invalid_argument("split_module: child " + path + " (" + module.name() +
                                ") has parameters on different devices (" + listing +
                                "); move it to one device or wrap it in WithDevice");
  }
  return Device::from_torch(device);
}

void flatten(const torch::nn::Sequential& sequential, const std::string& prefix,
             std::vector<Child>& out) {
  const auto names = sequential->named_children().keys();
  size_t k = 0;
  for (const torch::nn::AnyModule& any : *sequential) {
    const std::string path = prefix + (k < names.size() ? names[k] : std::to_string(k));
    ++k;
    std::shared_ptr<torch::nn::Module> ptr = any.ptr();
    if (auto nested = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(ptr)) {
      flatten(torch::nn::Sequential(nested), path + ".", out);
    } else if (auto pinned = std::dynamic_pointer_cast<WithDeviceImpl>(ptr)) {
      pinned->module().ptr()->to(pinned->device().torch_device());
      out.push_back({path, any, pinned->device()});
    } else {
      out.push_back({path, any, device_of_parameters(*ptr, path)});
    }
  }
}

}  // namespace

SplitModule split_module(const torch::nn::Sequential& module) {
  TORCH_CHECK(!module.is_empty(), "split_module: the Sequential is a null module holder");
  std::vector<Child> children;
  flatten(module, "", children);
  if (children.empty()) throw std::invalid_argument("split_module: the Sequential has no children");

  SplitModule split;
  for (Child& child : children) {
    if (split.devices.empty() || split.devices.back() != child.device) {
      split.partitions.emplace_back();
      split.devices.push_back(child.device);
    }
    std::string name = child.path;
    std::replace(name.begin(), name.end(), '.', '_');  // module names may not contain dots
    split.partitions.back()->push_back(name, std::move(child.module));
  }
  return split;
}

}  // namespace harness::pipeline
