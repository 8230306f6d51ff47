// The counting CPU allocator behind activation_meter.h.
#include "harness/pipeline/activation_meter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <array>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace harness::pipeline {
namespace {

constexpr int kMaxDevices = 64;

thread_local int scope_device = -1;
std::array<std::atomic<int64_t>, kMaxDevices> live{};
std::array<std::atomic<int64_t>, kMaxDevices> peak{};
std::atomic<int64_t> process_live{0};  // every metered allocation, in a scope or not
std::atomic<int64_t> process_peak{0};
std::atomic<int64_t> window_start{0};  // what was live when the window began
std::atomic<int64_t> window_peak{0};

struct Charge {
  int64_t bytes;
  int device;  // -1: made outside any scope, counted for the process only
  c10::DeleterFnPtr deleter;  // the wrapped allocator's
};
std::mutex charges_mutex;
std::unordered_map<void*, Charge> charges;  // metered allocations by address
c10::Allocator* wrapped = nullptr;

void raise_peak(std::atomic<int64_t>& peak_bytes, int64_t now) {
  int64_t seen = peak_bytes.load();
  while (now > seen && !peak_bytes.compare_exchange_weak(seen, now)) {
  }
}

void charge(int device, int64_t bytes) {
  const int64_t now = process_live.fetch_add(bytes) + bytes;
  raise_peak(process_peak, now);
  raise_peak(window_peak, now);
  if (device >= 0) raise_peak(peak[device], live[device].fetch_add(bytes) + bytes);
}

// The deleter of every metered allocation, and the raw deleter: addresses it did not meter go to
// the wrapped allocator's own raw deleter.
void release(void* data) {
  Charge c{0, -1, nullptr};
  {
    std::lock_guard<std::mutex> lock(charges_mutex);
    auto it = charges.find(data);
    if (it != charges.end()) {
      c = it->second;
      charges.erase(it);
    }
  }
  if (c.deleter != nullptr) {
    process_live.fetch_sub(c.bytes);
    if (c.device >= 0) live[c.device].fetch_sub(c.bytes);
    c.deleter(data);
  } else {
    wrapped->raw_deleter()(data);
  }
}

class MeteredCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = wrapped->allocate(n);
    const int device = scope_device;
    // Only simple allocations (the data is its own context) can be re-wrapped without a context.
    if (n == 0 || inner.get() != inner.get_context()) return inner;
    void* data = inner.get();
    const c10::DeleterFnPtr deleter = inner.get_deleter();
    (void)inner.release_context();
    {
      std::lock_guard<std::mutex> lock(charges_mutex);
      charges[data] = {static_cast<int64_t>(n), device, deleter};
    }
    charge(device, static_cast<int64_t>(n));
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return wrapped->raw_deleter() ? &release : nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

std::once_flag installed_once;
std::atomic<bool> installed{false};

}  // namespace

void install_activation_meter() {
  std::call_once(installed_once, [] {
    wrapped = c10::GetCPUAllocator();
    static MeteredCPUAllocator metered;
    c10::SetCPUAllocator(&metered, /*priority=*/100);
    installed = c10::GetCPUAllocator() == &metered;
    if (!installed) throw std::runtime_error("install_activation_meter: torch kept its CPU allocator");
  });
}

bool activation_meter_installed() { return installed; }

ActivationScope::ActivationScope(int device) : previous_(scope_device) {
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("ActivationScope: device " + std::to_string(device) + " outside 0.." +
                                std::to_string(kMaxDevices - 1));
  }
  scope_device = device;
}

ActivationScope::~ActivationScope() { scope_device = previous_; }

std::vector<int64_t> activation_live_bytes(int devices) {
  std::vector<int64_t> out;
  for (int d = 0; d < devices && d < kMaxDevices; ++d) out.push_back(live[d].load());
  return out;
}

std::vector<int64_t> activation_peak_bytes(int devices) {
  std::vector<int64_t> out;
  for (int d = 0; d < devices && d < kMaxDevices; ++d) out.push_back(peak[d].load());
  return out;
}

void reset_activation_peaks() {
  for (int d = 0; d < kMaxDevices; ++d) peak[d] = live[d].load();
}

int64_t cpu_tensor_live_bytes() { return process_live.load(); }

int64_t cpu_tensor_peak_bytes() { return process_peak.load(); }

void restart_cpu_tensor_window() {
  const int64_t now = process_live.load();
  window_start = now;
  window_peak = now;
}

int64_t cpu_tensor_window_increase() { return window_peak.load() - window_start.load(); }

}  // namespace harness::pipeline
