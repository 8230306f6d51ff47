// The two pieces of a checkpoint that does not stall training (--async_checkpoint): the state
// copied into host buffers that live across checkpoints (pinned memory for GPU tensors, so the
// copy runs at the bus's speed and nothing is allocated per checkpoint), and one background
// thread that writes a checkpoint while training goes on. The next checkpoint's copy waits until
// the previous write has finished, so one snapshot is ever held.
#pragma once

#include <ATen/core/Tensor.h>

#include <exception>
#include <functional>
#include <map>
#include <string>
#include <thread>

namespace harness::train {

class HostSnapshot {
 public:
  // A host copy of `source` kept under `key`: the buffer of the last call with that key is reused
  // when shape and dtype match. GPU sources are copied asynchronously into pinned memory; call
  // finish() before reading the copies.
  at::Tensor copy(const std::string& key, const at::Tensor& source);
  // Waits for the copies from GPUs.
  void finish();

 private:
  std::map<std::string, at::Tensor> buffers_;
  bool from_gpu_ = false;
};

class BackgroundWriter {
 public:
  BackgroundWriter() = default;
  // Waits for a write under way; an error in it is reported on stderr (a destructor cannot throw).
  ~BackgroundWriter();
  BackgroundWriter(const BackgroundWriter&) = delete;
  BackgroundWriter& operator=(const BackgroundWriter&) = delete;

  // Waits for the previous write (rethrowing its error), then starts `write` on a new thread.
  void submit(std::function<void()> write);
  // Waits for the write under way, if any; rethrows the exception it ended with.
  void wait();
  bool busy() const { return thread_.joinable(); }

 private:
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace harness::train
