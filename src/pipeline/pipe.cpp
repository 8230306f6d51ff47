// The Pipe executor: applies clock_cycles (forward) and backward_clock_cycles (pipelined
// backward) to per-device workers.
#include "harness/pipeline/pipe.h"

#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include <set>
#include <stdexcept>
#include <string>

#include "harness/pipeline/partition.h"
#include "harness/pipeline/schedule.h"
#include "harness/pipeline/worker.h"

namespace harness::pipeline {
namespace {

using torch::autograd::variable_list;

std::string task_name(const char* phase, int i, int j) {
  return std::string(phase) + " of micro-batch " + std::to_string(i) + ", partition " +
         std::to_string(j);
}

Tracer::Args task_args(int i, int j) {
  return {{"micro_batch", static_cast<int64_t>(i)}, {"partition", static_cast<int64_t>(j)}};
}

// What one forward leaves for its pipelined backward: each task's (detached) input and output.
struct PipeRun {
  int m = 0, n = 0;
  int64_t split_size = 0;
  std::vector<Device> devices;
  std::weak_ptr<Workers> workers;
  Tracer* tracer = nullptr;
  c10::Device input_device = c10::kCPU;
  bool input_requires_grad = false;
  std::vector<std::vector<int64_t>> input_chunk_sizes;  // shape of each micro-batch of x
  std::vector<std::vector<at::Tensor>> inputs, outputs;  // [i][j]
  bool consumed = false;
};

// Autograd node on the Pipe's output whose backward drives the backward clock on the workers.
class PipeBackward : public torch::autograd::Node {
 public:
  explicit PipeBackward(std::shared_ptr<PipeRun> run) : run_(std::move(run)) {}
  std::string name() const override { return "harness::pipeline::PipeBackward"; }
  void release_variables() override { run_.reset(); }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(run_ && !run_->consumed,
                "Pipe: backward through this output ran already (or its graph was freed); the "
                "pipelined backward supports one backward per forward");
    std::shared_ptr<Workers> workers = run_->workers.lock();
    TORCH_CHECK(workers, "Pipe: the Pipe was destroyed before backward reached its output");
    PipeRun& run = *run_;
    run.consumed = true;
    const int m = run.m, n = run.n;

    std::vector<std::vector<at::Tensor>> grad_outputs(m, std::vector<at::Tensor>(n));
    std::vector<at::Tensor> grad_inputs(m);
    if (grads[0].defined()) {
      const auto chunks = grads[0].split(run.split_size, 0);
      for (int i = 0; i < m; ++i) grad_outputs[i][n - 1] = chunks[i];
    }
    for (const Cycle& cycle : backward_clock_cycles(m, n)) {
      std::vector<WorkerTask> tasks;
      for (const auto& [i, j] : cycle) {
        tasks.push_back({&workers->at(run.devices[j]),
                         [&run, &grad_outputs, &grad_inputs, i = i, j = j] {
                           TraceScope scope(run.tracer, "backward", run.devices[j].str(), task_args(i, j));
                           at::Tensor output = std::move(run.outputs[i][j]);
                           at::Tensor input = std::move(run.inputs[i][j]);
                           at::Tensor grad = std::move(grad_outputs[i][j]);
                           if (grad.defined() && output.requires_grad()) {
                             torch::autograd::backward({output}, {grad.to(output.device(), /*non_blocking=*/output.is_cuda())});
                           }
                           at::Tensor grad_input = input.requires_grad() ? input.grad() : at::Tensor();
                           if (j > 0) {
                             grad_outputs[i][j - 1] = grad_input;
                           } else {
                             grad_inputs[i] = grad_input;
                           }
                         },
                         task_name("backward", i, j)});
      }
      run_concurrently(std::move(tasks));
    }

    at::Tensor grad_x;
    if (run.input_requires_grad) {
      bool any = false;
      for (const auto& g : grad_inputs) any = any || g.defined();
      if (any) {
        std::vector<at::Tensor> parts;
        for (int i = 0; i < m; ++i) {
          parts.push_back(grad_inputs[i].defined()
                              ? grad_inputs[i].to(run.input_device)
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

  std::set<Device> distinct(devices_.begin(), devices_.end());
  if (options_.pipelined_backward) {
    for (const Device& d : distinct) {
      if (d.is_cuda()) {
        throw std::invalid_argument(
            "Pipe: pipelined_backward is for CPU lanes only; on " + d.str() +
            " its autograd node would block the engine thread the workers' backward needs (use "
            "pipeline::ScheduleExecutor to train with the backward on the workers)");
      }
    }
  }
  int cpu_lanes = 0;
  for (const Device& d : distinct) cpu_lanes += d.is_cpu() ? 1 : 0;
  if (options_.threads_per_device < 0) {
    throw std::invalid_argument("Pipe: threads_per_device must be >= 0 (0 = default), got " +
                                std::to_string(options_.threads_per_device));
  }
  const int threads = options_.threads_per_device > 0
                          ? options_.threads_per_device
                          : default_threads_per_device(std::max(1, cpu_lanes));
  workers_ = std::make_shared<Workers>(devices_, threads);
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
  auto run = std::make_shared<PipeRun>();
  run->m = static_cast<int>(chunks.size());
  run->n = static_cast<int>(partitions_.size());
  run->split_size = split_size_;
  run->devices = devices_;
  run->workers = workers_;
  run->tracer = options_.tracer;
  run->input_device = x.device();
  run->input_requires_grad = x.requires_grad();
  run->inputs.assign(run->m, std::vector<at::Tensor>(run->n));
  run->outputs.assign(run->m, std::vector<at::Tensor>(run->n));
  for (const auto& chunk : chunks) run->input_chunk_sizes.push_back(chunk.sizes().vec());

  PipeRun& r = *run;
  for (const Cycle& cycle : clock_cycles(r.m, r.n)) {
    std::vector<WorkerTask> tasks;
    for (const auto& [i, j] : cycle) {
      tasks.push_back({&workers_->at(devices_[j]),
                       [this, &r, &chunks, pipelined_backward, i = i, j = j] {
                         TraceScope scope(r.tracer, "forward", devices_[j].str(), task_args(i, j));
                         const at::Tensor& previous = j == 0 ? chunks[i] : r.outputs[i][j - 1];
                         // Asynchronous only toward a GPU: a CPU consumer must see the finished copy.
                         at::Tensor input = previous.to(devices_[j].torch_device(), /*non_blocking=*/devices_[j].is_cuda());
                         if (pipelined_backward) {
                           // Cut the graph here: this task's backward runs on this worker.
                           input = input.detach().requires_grad_(previous.requires_grad());
                           r.inputs[i][j] = input;
                         }
                         r.outputs[i][j] = partitions_[j]->forward(input);
                       },
                       task_name("forward", i, j)});
    }
    run_concurrently(std::move(tasks));
  }

  std::vector<at::Tensor> last;
  for (int i = 0; i < r.m; ++i) last.push_back(r.outputs[i][r.n - 1]);
  if (!pipelined_backward) return at::cat(last, 0);

  at::Tensor output;
  {
    at::NoGradGuard no_grad;
    output = at::cat(last, 0);
  }
  auto node = std::shared_ptr<PipeBackward>(new PipeBackward(run), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

}  // namespace harness::pipeline
