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
// any scope is charged to no device (only to the process's figures below); allocations made
// before stay as they were.
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

// Every CPU allocation made since the meter was installed, in a scope or not, on any thread: the
// bytes still allocated and the most there ever were at once. The CPU's analogue of CUDA's
// allocated-bytes statistics (torch.cuda.max_memory_allocated): the tensors alone, without the
// allocator's free space or the libraries' own memory that a resident-set figure also holds.
int64_t cpu_tensor_live_bytes();
int64_t cpu_tensor_peak_bytes();

// A window over the process's figures, as torch.cuda.reset_peak_memory_stats() opens one: the most
// bytes allocated at once since the last restart, over what was live at that restart.
void restart_cpu_tensor_window();
int64_t cpu_tensor_window_increase();

}  // namespace harness::pipeline
