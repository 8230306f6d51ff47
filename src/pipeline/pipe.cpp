// The Pipe, a view onto the schedule engine: its forward runs GPipe's forward half
// (gpipe_plan_halves, the clock of clock_cycles) on a ScheduleExecutor's workers, and its pipelined
// backward the backward half, from an autograd node on the output.
#include "harness/pipeline/pipe.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "harness/pipeline/executor.h"
#include "harness/pipeline/gpipe_plan.h"
#include "harness/pipeline/partition.h"

namespace harness::pipeline {
namespace {

using torch::autograd::variable_list;

// The seed of a Pipe's random streams, from torch's default CPU generator, so that
// torch::manual_seed before the Pipe is made fixes every dropout mask it draws.
uint64_t seed_from_default_generator() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get<at::CPUGeneratorImpl>()->random64();
}

// What one forward with the pipelined backward leaves for it: the pipeline's ends, holding each
// (micro-batch, partition)'s detached input and its output.
struct PipeRun {
  PipeRun(int m_, int n_) : m(m_), n(n_), ends(m_, n_) {}
  int m, n;
  int64_t split_size = 0;
  StageEnds ends;
  std::weak_ptr<ScheduleExecutor> executor;
  StageForward forward;
  uint64_t step_seed = 0;
  c10::Device input_device = c10::kCPU;
  bool input_requires_grad = false;
  std::vector<std::vector<int64_t>> input_chunk_sizes;  // shape of each micro-batch of x
  bool consumed = false;
};

// Autograd node on the Pipe's output whose backward runs GPipe's backward half on the workers. It
// waits for them on the thread that runs it, which is why the Pipe allows it on CPU lanes only:
// there the engine runs it on the thread that called backward, never on a device's engine thread.
class PipeBackward : public torch::autograd::Node {
 public:
  explicit PipeBackward(std::shared_ptr<PipeRun> run) : run_(std::move(run)) {}
  std::string name() const override { return "harness::pipeline::PipeBackward"; }
  void release_variables() override { run_.reset(); }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(run_ && !run_->consumed,
                "Pipe: backward through this output ran already (or its graph was freed); the "
                "pipelined backward supports one backward per forward");
    std::shared_ptr<ScheduleExecutor> executor = run_->executor.lock();
    TORCH_CHECK(executor, "Pipe: the Pipe was destroyed before backward reached its output");
    PipeRun& run = *run_;
    run.consumed = true;
    const int m = run.m, n = run.n;

    if (grads[0].defined()) {
      const auto chunks = grads[0].split(run.split_size, 0);
      for (int i = 0; i < m; ++i) run.ends.grad_outputs[i] = chunks[i];
    }
    executor->run_plan(gpipe_plan_halves(m, n).backward, run.forward, run.step_seed, &run.ends);

    at::Tensor grad_x;
    if (run.input_requires_grad) {
      bool any = false;
      for (const auto& g : run.ends.grad_inputs) any = any || g.defined();
      if (any) {
        std::vector<at::Tensor> parts;
        for (int i = 0; i < m; ++i) {
          const at::Tensor& g = run.ends.grad_inputs[i];
          parts.push_back(g.defined() ? g.to(run.input_device)
                                      : at::zeros(run.input_chunk_sizes[i],
                                                  grads[0].options().device(run.input_device)));
        }
        grad_x = at::cat(parts, 0);
      }
    }
    run_.reset();
    return {grad_x};
  }

 private:
  std::shared_ptr<PipeRun> run_;
};

}  // namespace

Pipe::Pipe(torch::nn::Sequential module, int64_t split_size, PipeOptions options)
    : module_(std::move(module)), split_size_(0), options_(options) {
  set_split_size(split_size);
  SplitModule split = split_module(module_);
  partitions_ = std::move(split.partitions);
  devices_ = std::move(split.devices);
  register_module("module", module_);

  if (options_.pipelined_backward) {
    for (const Device& d : std::set<Device>(devices_.begin(), devices_.end())) {
      if (d.is_cuda()) {
        throw std::invalid_argument(
            "Pipe: pipelined_backward is for CPU lanes only; on " + d.str() +
            " its autograd node would block the engine thread the workers' backward needs (use "
            "pipeline::ScheduleExecutor to train with the backward on the workers)");
      }
    }
  }
  if (options_.threads_per_device < 0) {
    throw std::invalid_argument("Pipe: threads_per_device must be >= 0 (0 = default), got " +
                                std::to_string(options_.threads_per_device));
  }
  ExecutorOptions executor_options;
  executor_options.threads_per_device = options_.threads_per_device;
  executor_options.tracer = options_.tracer;
  executor_options.stage_word = "partition";
  executor_ = std::make_shared<ScheduleExecutor>(devices_, executor_options);
  seed_ = seed_from_default_generator();
}

Pipe::~Pipe() = default;

void Pipe::set_split_size(int64_t split_size) {
  if (split_size < 1) {
    throw std::invalid_argument("Pipe: split_size must be >= 1, got " + std::to_string(split_size));
  }
  split_size_ = split_size;
}

at::Tensor Pipe::forward(const at::Tensor& x) {
  TORCH_CHECK(x.defined(), "Pipe::forward: the input tensor is undefined");
  TORCH_CHECK(x.dim() >= 1 && x.size(0) >= 1, "Pipe::forward: the input needs a non-empty batch ",
              "dimension 0, got shape ", x.sizes());
  bool parameters_need_grad = false;
  for (const auto& p : module_->parameters()) parameters_need_grad = parameters_need_grad || p.requires_grad();
  const bool pipelined_backward = options_.pipelined_backward && torch::GradMode::is_enabled() &&
                                  (x.requires_grad() || parameters_need_grad);

  const std::vector<at::Tensor> chunks = x.split(split_size_, 0);
  auto run = std::make_shared<PipeRun>(static_cast<int>(chunks.size()), static_cast<int>(partitions_.size()));
  run->split_size = split_size_;
  run->executor = executor_;
  run->forward = [partitions = partitions_](int, int j, const at::Tensor& input) {
    return partitions[j].ptr()->forward(input);
  };
  run->step_seed = step_stream_seed(seed_, forwards_++);
  run->input_device = x.device();
  run->input_requires_grad = x.requires_grad();
  for (const auto& chunk : chunks) run->input_chunk_sizes.push_back(chunk.sizes().vec());
  run->ends.inputs = chunks;
  // Without the pipelined backward the graph stays whole, for the autograd engine to run back.
  run->ends.keep_graph = !pipelined_backward;
  executor_->run_plan(gpipe_plan_halves(run->m, run->n).forward, run->forward, run->step_seed, &run->ends);
  for (at::Tensor& input : run->ends.inputs) input = at::Tensor();  // stage 0 holds its own
  if (!pipelined_backward) return at::cat(run->ends.outputs, 0);

  at::Tensor output;
  {
    at::NoGradGuard no_grad;
    output = at::cat(run->ends.outputs, 0);
  }
  for (at::Tensor& out : run->ends.outputs) out = at::Tensor();
  auto node = std::shared_ptr<PipeBackward>(new PipeBackward(run), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

}  // namespace harness::pipeline
