// Parsing and defaults for harness::Device.
#include "harness/device.h"

#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace harness {

Device Device::parse(const std::string& text) {
  auto colon = text.find(':');
  std::string kind = text.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string number = text.substr(colon + 1);
    if (number.empty() || !std::all_of(number.begin(), number.end(), ::isdigit)) {
      throw std::invalid_argument("device '" + text + "': the index after ':' must be a number");
    }
    index = std::stoi(number);
  }
  if (kind == "cpu") return cpu(index);
  if (kind == "cuda" || kind == "gpu") return cuda(index);
  throw std::invalid_argument("device '" + text + "': expected cpu[:k] or cuda[:k]");
}

DeviceChoice parse_device_choice(const std::string& text) {
  if (text == "auto") return DeviceChoice::kAuto;
  if (text == "cpu") return DeviceChoice::kCpu;
  if (text == "cuda") return DeviceChoice::kCuda;
  throw std::invalid_argument("--device '" + text + "': expected auto, cpu or cuda");
}

bool uses_gpus(DeviceChoice choice) {
  return choice == DeviceChoice::kCuda || (choice == DeviceChoice::kAuto && torch::cuda::is_available());
}

c10::Device Device::torch_device() const {
  return is_cuda() ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index))
                   : c10::Device(c10::kCPU);
}

Device Device::from_torch(const c10::Device& device) {
  if (device.is_cpu()) return cpu(0);
  if (device.is_cuda()) return cuda(device.has_index() ? device.index() : 0);
  throw std::invalid_argument("device '" + device.str() + "' is neither a CPU nor a CUDA device");
}

std::string Device::str() const {
  return std::string(is_cuda() ? "cuda:" : "cpu:") + std::to_string(index);
}

std::vector<Device> parse_device_list(const std::string& csv) {
  std::vector<Device> devices;
  std::set<Device> seen;
  std::stringstream stream(csv);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty()) continue;
    Device d = Device::parse(item);
    if (!seen.insert(d).second) {
      throw std::invalid_argument("--devices '" + csv + "': " + d.str() + " is listed twice");
    }
    if (d.is_cuda()) {
      const int present = static_cast<int>(torch::cuda::device_count());
      if (d.index >= present) {
        throw std::invalid_argument("--devices '" + csv + "': " + d.str() + " requested but " +
                                    std::to_string(present) + " GPU(s) are present");
      }
    }
    devices.push_back(d);
  }
  if (devices.empty()) throw std::invalid_argument("--devices '" + csv + "' names no device");
  return devices;
}

std::vector<Device> default_devices() {
  std::vector<Device> devices;
  const int gpus = static_cast<int>(torch::cuda::device_count());
  for (int i = 0; i < gpus; ++i) devices.push_back(Device::cuda(i));
  if (devices.empty()) devices = {Device::cpu(0), Device::cpu(1)};
  return devices;
}

void enter_device_lane(const Device& device, int intra_op_threads) {
  if (intra_op_threads < 1) {
    throw std::invalid_argument("device lane " + device.str() + ": intra-op threads must be >= 1, got " +
                                std::to_string(intra_op_threads));
  }
  // ATen initialises each thread's width lazily from the process-wide value (the last one any
  // thread set) the first time the thread runs parallel work; trigger that now, both in our code
  // and inside libtorch (each has its own copy of the once-per-thread flag), so it cannot later
  // overwrite this lane's width.
  at::internal::lazy_init_num_threads();
  (void)at::get_num_threads();
  at::set_num_threads(intra_op_threads);
  if (device.is_cuda()) {
    c10::impl::getDeviceGuardImpl(c10::kCUDA)
        ->setDevice(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index)));
  }
}

int default_threads_per_device(int n_devices) {
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, cores / std::max(1, n_devices));
}

}  // namespace harness
