// The devices work is placed on: CUDA GPUs, and CPU "devices" (cpu:0, cpu:1, ...), each a
// separate lane with its own worker thread and its own share of the cores, so that model and
// pipeline parallelism are real on a machine without a GPU.
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <vector>

namespace harness {

struct Device {
  enum class Kind { kCpu, kCuda };

  Kind kind = Kind::kCpu;
  int index = 0;  // cpu:k lane number, or the CUDA ordinal

  static Device cpu(int lane = 0) { return {Kind::kCpu, lane}; }
  static Device cuda(int ordinal) { return {Kind::kCuda, ordinal}; }
  // The lane a torch device denotes: any CPU tensor is on cpu:0 (lanes differ only by name, see
  // pipeline::WithDevice), cuda without an index is cuda:0.
  static Device from_torch(const c10::Device& device);

  // "cpu", "cpu:1", "cuda", "cuda:0". Throws std::invalid_argument naming the text.
  static Device parse(const std::string& text);

  bool is_cuda() const { return kind == Kind::kCuda; }
  bool is_cpu() const { return kind == Kind::kCpu; }
  // Where tensors of this device live: every CPU lane is torch's CPU device.
  c10::Device torch_device() const;
  std::string str() const;

  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool operator<(const Device& o) const {
    return kind != o.kind ? kind < o.kind : index < o.index;
  }
};

// run_data_parallel's --device: where each rank runs. kAuto: its GPU when the host has GPUs.
enum class DeviceChoice { kAuto, kCpu, kCuda };

// "auto" / "cpu" / "cuda"; anything else throws std::invalid_argument naming --device.
DeviceChoice parse_device_choice(const std::string& text);
// Whether `choice` puts ranks on GPUs here: kCuda, or kAuto on a host with one.
bool uses_gpus(DeviceChoice choice);

// "cpu:0,cpu:1" or "cuda:0,cuda:1". Rejects duplicates, unknown kinds, and CUDA ordinals beyond
// the GPUs present (naming the flag value at fault).
std::vector<Device> parse_device_list(const std::string& csv);

// Every GPU when there is one, else cpu:0 and cpu:1.
std::vector<Device> default_devices();

// Makes the calling thread a worker of `device`: its ATen intra-op width becomes
// `intra_op_threads` (with OpenMP this is per thread, so each lane keeps its share of the cores),
// and on CUDA lanes the current GPU becomes `device`. Call it first thing in the lane's thread.
void enter_device_lane(const Device& device, int intra_op_threads);

// Intra-op threads each of `n_devices` CPU lanes gets by default: cores / n_devices, at least 1.
int default_threads_per_device(int n_devices);

}  // namespace harness
