// GPipe over a Sequential: the batch is cut into micro-batches that flow through per-device
// partitions in clock cycles, each partition on its device's own worker thread. By default the
// backward is pipelined too: the output carries an autograd node that, when loss.backward()
// reaches it, runs every partition's backward for every micro-batch on that partition's worker in
// reverse clock order (CPU autograd would otherwise run the whole backward on one thread).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "harness/device.h"
#include "harness/trace.h"

namespace harness::pipeline {

class Workers;

struct PipeOptions {
  // Intra-op threads of each device's worker; 0: default_threads_per_device(distinct devices).
  int threads_per_device = 0;
  // Records one slice per task ("forward"/"backward", track = device, args micro_batch and
  // partition) when set. Not owned; must outlive the Pipe.
  Tracer* tracer = nullptr;
  // Run the backward of each (micro-batch, partition) on the partition's worker, in the reverse
  // clock. Off: the autograd engine runs the whole backward on the thread calling backward().
  bool pipelined_backward = true;
};

class Pipe : public torch::nn::Module {
 public:
  // Splits `module` with split_module and starts one worker per distinct device.
  // Throws std::invalid_argument when split_size < 1 or the module is empty.
  Pipe(torch::nn::Sequential module, int64_t split_size, PipeOptions options = {});
  ~Pipe() override;

  // x [B, ...] on any device -> the module's output for the whole batch, concatenated along
  // dimension 0 on the last partition's device. Micro-batches have split_size rows (the last may
  // be shorter). Gradients equal those of module->forward(x). Not reentrant: one forward at a
  // time per Pipe. With the pipelined backward, backward through one forward's output works once.
  at::Tensor forward(const at::Tensor& x);

  int64_t split_size() const { return split_size_; }
  void set_split_size(int64_t split_size);
  const std::vector<torch::nn::Sequential>& partitions() const { return partitions_; }
  const std::vector<Device>& devices() const { return devices_; }
  const PipeOptions& options() const { return options_; }

 private:
  torch::nn::Sequential module_;
  std::vector<torch::nn::Sequential> partitions_;
  std::vector<Device> devices_;
  int64_t split_size_;
  PipeOptions options_;
  std::shared_ptr<Workers> workers_;  // backward nodes hold a weak_ptr
};

}  // namespace harness::pipeline
