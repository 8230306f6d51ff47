// Host snapshots and the background checkpoint writer (see async_checkpoint.h).
#include "harness/train/checkpoint/async_checkpoint.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <iostream>

namespace harness::train {

at::Tensor HostSnapshot::copy(const std::string& key, const at::Tensor& source) {
  torch::NoGradGuard no_grad;
  const at::Tensor from = source.detach();
  at::Tensor& buffer = buffers_[key];
  if (!buffer.defined() || buffer.sizes() != from.sizes() || buffer.scalar_type() != from.scalar_type()) {
    buffer = at::empty(from.sizes(), from.options().device(at::kCPU).pinned_memory(from.is_cuda()));
  }
  buffer.copy_(from, /*non_blocking=*/from.is_cuda());
  from_gpu_ = from_gpu_ || from.is_cuda();
  return buffer;
}

void HostSnapshot::finish() {
  if (from_gpu_) torch::cuda::synchronize();
  from_gpu_ = false;
}

BackgroundWriter::~BackgroundWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::cerr << "checkpoint: the background write failed: " << e.what() << std::endl;
  }
}

void BackgroundWriter::submit(std::function<void()> write) {
  wait();
  thread_ = std::thread([this, write = std::move(write)] {
    try {
      write();
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

void BackgroundWriter::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

}  // namespace harness::train
