// GPipe over a Sequential (the original's a5_2_2 Pipe): the batch is cut into micro-batches that
// flow through per-device partitions in clock cycles, each partition on its device's own worker
// thread; the backward runs through autograd from the caller's loss.backward(), as the original's.
// The Pipe is a view onto the schedule engine (executor.h): its clock cycles are GPipe's forward
// half as the engine's plan (gpipe_plan.h), run by a ScheduleExecutor's workers. Training through
// a schedule, with the backward on the workers, is executor.h's job.
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

class ScheduleExecutor;

struct PipeOptions {
  // Intra-op threads of each device's worker; 0: default_threads_per_device(distinct devices).
  int threads_per_device = 0;
  // Records one slice per task ("forward"/"backward", track = device, args micro_batch and
  // partition) when set. Not owned; must outlive the Pipe.
  Tracer* tracer = nullptr;
  // Run the backward of each (micro-batch, partition) on the partition's worker, in the reverse
  // clock (the engine's backward half of GPipe), from an autograd node on the output. Off (the
  // default, the original's behaviour): the autograd engine runs the whole backward. CPU lanes
  // only: on a GPU the node would wait on the engine thread that the workers' own backward calls
  // need, so the Pipe refuses it there.
  bool pipelined_backward = false;
};

class Pipe : public torch::nn::Module {
 public:
  // Splits `module` with split_module and starts one worker per distinct device. (The engine's
  // workers are lanes, one per partition: split_module puts consecutive partitions on different
  // devices, so only a device the Sequential returns to later would hold two lanes.)
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
  std::shared_ptr<ScheduleExecutor> executor_;  // backward nodes hold a weak_ptr
  uint64_t seed_ = 0;     // of the random streams, drawn from torch's default CPU generator
  int64_t forwards_ = 0;  // forwards run: each has streams of its own (step_stream_seed)
};

}  // namespace harness::pipeline
