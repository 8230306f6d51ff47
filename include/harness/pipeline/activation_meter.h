// Measures the activation memory each pipeline device holds. Once installed, a counting wrapper
// around torch's CPU allocator charges every CPU allocation made inside an ActivationScope to the
// scope's device until that memory is freed, and keeps each device's peak. The executor opens a
// scope around every stage forward (and recomputation), so a device's peak is the most memory its
// held activations ever took at once: what a schedule and a checkpointing mode cost. For the
// benchmarks; CPU memory only (a GPU's own allocator keeps its own statistics).
#pragma once

#include <cstdint>
#include <vector>

namespace harness::pipeline {

// Installs the counting allocator as torch's CPU allocator (idempotent). Memory allocated outside
// any scope passes through uncounted; allocations made before stay as they were.
void install_activation_meter();
bool activation_meter_installed();

// While alive, the calling thread's CPU allocations are charged to `device` (0 .. 63).
class ActivationScope {
 public:
  explicit ActivationScope(int device);
  ~ActivationScope();
  ActivationScope(const ActivationScope&) = delete;
  ActivationScope& operator=(const ActivationScope&) = delete;

 private:
  int previous_;
};

// Bytes charged to each device and still allocated, and the most there ever were since the last
// reset (the peaks restart from what is live now). Entries for devices 0 .. devices - 1.
std::vector<int64_t> activation_live_bytes(int devices);
std::vector<int64_t> activation_peak_bytes(int devices);
void reset_activation_peaks();

}  // namespace harness::pipeline
