// The schedule executor (see executor.h).
#include "harness/pipeline/executor.h"

#include <torch/torch.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "harness/model/dropout.h"
#include "harness/pipeline/activation_meter.h"
#include "harness/pipeline/worker.h"

namespace harness::pipeline {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Raised in a worker that was waiting when another one failed; the other's error is reported.
struct Stopped : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The tensors crossing stages in one step, and the stop signal. activations[i][s]: the output of
// forward (i, s) for stage s + 1; gradients[i][s]: the gradient of forward (i, s)'s input for
// stage s - 1.
class Exchange {
 public:
  Exchange(int micro_batches, int stages)
      : activations_(micro_batches, std::vector<Slot>(stages)),
        gradients_(micro_batches, std::vector<Slot>(stages)) {}

  void put_activation(int i, int s, at::Tensor t) { put(activations_[i][s], std::move(t)); }
  void put_gradient(int i, int s, at::Tensor t) { put(gradients_[i][s], std::move(t)); }
  at::Tensor take_activation(int i, int s) { return take(activations_[i][s]); }
  at::Tensor take_gradient(int i, int s) { return take(gradients_[i][s]); }

  // The first failing device; later ones (and the waiters it wakes) are not the cause.
  void fail(int device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_device_ < 0) failed_device_ = device;
    }
    changed_.notify_all();
  }
  int failed_device() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failed_device_;
  }

 private:
  struct Slot {
    at::Tensor tensor;
    bool ready = false;
  };
  void put(Slot& slot, at::Tensor t) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot.tensor = std::move(t);
      slot.ready = true;
    }
    changed_.notify_all();
  }
  at::Tensor take(Slot& slot) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return slot.ready || failed_device_ >= 0; });
    if (!slot.ready) throw Stopped("stopped: device " + std::to_string(failed_device_) + " failed");
    slot.ready = false;
    return std::move(slot.tensor);
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::vector<Slot>> activations_, gradients_;
  int failed_device_ = -1;
};

// Toward a GPU the copy may run asynchronously; toward the CPU it must have finished before the
// CPU reads it. A copy between GPUs runs on the source's current stream, ordered by events after
// the producer's work and before the consumer's: correct because every worker stays on its
// device's default stream (enter_device_lane sets none).
at::Tensor to_stage_device(const at::Tensor& t, const Device& device) {
  return t.to(device.torch_device(), /*non_blocking=*/device.is_cuda());
}

}  // namespace

ActivationCheckpointing parse_activation_checkpointing(const std::string& text) {
  if (text == "never") return ActivationCheckpointing::kNever;
  if (text == "except_last") return ActivationCheckpointing::kExceptLast;
  if (text == "always") return ActivationCheckpointing::kAlways;
  throw std::invalid_argument("--activation_checkpointing must be always, except_last or never, got '" +
                              text + "'");
}

std::string to_string(ActivationCheckpointing mode) {
  switch (mode) {
    case ActivationCheckpointing::kNever: return "never";
    case ActivationCheckpointing::kExceptLast: return "except_last";
    case ActivationCheckpointing::kAlways: return "always";
  }
  return "?";
}

std::vector<std::vector<bool>> checkpoint_plan(const TrainingSchedule& schedule, ActivationCheckpointing mode) {
  std::vector<std::vector<bool>> plan;
  for (const std::vector<Action>& actions : schedule.per_device) {
    std::vector<bool> row(actions.size(), false);
    for (size_t k = 0; k < actions.size(); ++k) {
      const Action& a = actions[k];
      if (a.kind != Action::Kind::kForward || mode == ActivationCheckpointing::kNever) continue;
      const bool backward_next = k + 1 < actions.size() && actions[k + 1] == Action::backward(a.micro_batch, a.stage);
      row[k] = mode == ActivationCheckpointing::kAlways || !backward_next;
    }
    plan.push_back(std::move(row));
  }
  return plan;
}

uint64_t step_stream_seed(uint64_t seed, int64_t global_step) {
  return splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(global_step));
}

uint64_t stage_stream_seed(uint64_t step_seed, int micro_batch, int stage) {
  return splitmix64(splitmix64(step_seed ^ static_cast<uint64_t>(micro_batch)) ^
                    (static_cast<uint64_t>(stage) << 32));
}

ScheduleExecutor::ScheduleExecutor(std::vector<Device> devices, ExecutorOptions options)
    : devices_(std::move(devices)), options_(options) {
  if (devices_.empty()) throw std::invalid_argument("ScheduleExecutor: no devices given");
  if (options_.threads_per_device < 0) {
    throw std::invalid_argument("ScheduleExecutor: threads_per_device must be >= 0 (0 = default), got " +
                                std::to_string(options_.threads_per_device));
  }
  int cpu_lanes = 0;
  std::map<Device, int> uses;
  for (const Device& d : devices_) {
    cpu_lanes += d.is_cpu() ? 1 : 0;
    ++uses[d];
  }
  threads_per_device_ = options_.threads_per_device > 0 ? options_.threads_per_device
                                                        : default_threads_per_device(std::max(1, cpu_lanes));
  // Each worker's at::set_num_threads would otherwise also set the width of threads ATen
  // initialises later, the caller's among them.
  at::internal::lazy_init_num_threads();
  (void)at::get_num_threads();
  for (size_t d = 0; d < devices_.size(); ++d) {
    workers_.push_back(std::make_unique<Worker>(devices_[d], threads_per_device_));
    tracks_.push_back(uses[devices_[d]] > 1 ? devices_[d].str() + "#" + std::to_string(d)
                                            : devices_[d].str());
  }
}

ScheduleExecutor::~ScheduleExecutor() = default;

StepResult ScheduleExecutor::run(const TrainingSchedule& schedule, const StageForward& forward,
                                 uint64_t step_seed) {
  validate_schedule(schedule);
  const int D = schedule.devices, M = schedule.micro_batches, S = schedule.stages();
  if (D != static_cast<int>(devices_.size())) {
    throw std::invalid_argument("ScheduleExecutor: schedule '" + schedule.name + "' is for " +
                                std::to_string(D) + " devices, the executor has " +
                                std::to_string(devices_.size()));
  }
  TORCH_CHECK(static_cast<bool>(forward), "ScheduleExecutor::run: empty stage forward");

  Exchange exchange(M, S);
  StepResult result;
  result.losses.resize(M);
  result.peak_in_flight.assign(D, 0);
  const bool metered = activation_meter_installed();
  const std::vector<int64_t> live_before = metered ? activation_live_bytes(D) : std::vector<int64_t>();
  if (metered) result.peak_held_bytes.assign(D, 0);
  const std::vector<std::vector<bool>> plan = checkpoint_plan(schedule, options_.checkpointing);
  Tracer* tracer = options_.tracer;

  auto run_device = [&](int d) {
    const Device& device = devices_[d];
    const c10::Device torch_device = device.torch_device();
    struct Held {
      at::Tensor input, output;  // output undefined when checkpointed
      bool checkpointed = false;
    };
    std::map<std::pair<int, int>, Held> held;  // (micro-batch, stage) -> what its backward needs
    int peak = 0;

    auto stage_forward = [&](int i, int s, const at::Tensor& input) {
      ActivationScope charged(d);  // counted only when the benchmarks installed the meter
      const uint64_t seed = stage_stream_seed(step_seed, i, s);
      if (device.is_cuda()) {
        return model::with_default_generator_seeded(torch_device, seed, [&] { return forward(i, s, input); });
      }
      model::DropoutGeneratorScope stream(model::make_generator(torch_device, seed));
      return forward(i, s, input);
    };
    auto sample_held = [&] {
      if (!metered) return;
      result.peak_held_bytes[d] =
          std::max(result.peak_held_bytes[d], activation_live_bytes(d + 1)[d] - live_before[d]);
    };

    for (size_t k = 0; k < schedule.per_device[d].size(); ++k) {
      const Action& action = schedule.per_device[d][k];
      const int i = action.micro_batch, s = action.stage;
      const std::string label = (action.kind == Action::Kind::kForward ? "forward" : "backward") +
                                std::string(" of micro-batch ") + std::to_string(i) + ", stage " +
                                std::to_string(s);
      try {
        if (action.kind == Action::Kind::kForward) {
          at::Tensor input;
          if (s > 0) {
            input = to_stage_device(exchange.take_activation(i, s - 1), device).detach();
            if (metered && device.is_cpu()) {  // charge the held input to this device (see StepResult)
              ActivationScope charged(d);
              input = input.clone();
            }
            if (input.is_floating_point()) input.requires_grad_(true);
          }
          Held h;
          h.checkpointed = plan[d][k];
          at::Tensor output;
          {
            TraceScope scope(tracer, "forward", tracks_[d],
                             {{"micro_batch", static_cast<int64_t>(i)}, {"stage", static_cast<int64_t>(s)}});
            torch::AutoGradMode graph(!h.checkpointed);
            output = stage_forward(i, s, input);
          }
          TORCH_CHECK(output.defined(), "the stage returned an undefined tensor");
          if (s == S - 1) {
            TORCH_CHECK(output.numel() == 1, "the last stage must return a scalar loss, got shape ",
                        output.sizes());
            TORCH_CHECK(h.checkpointed || output.requires_grad(),
                        "the last stage's loss does not require grad: nothing to train");
            result.losses[i] = output.detach();
          } else {
            exchange.put_activation(i, s, output.detach());
          }
          h.input = input;
          if (!h.checkpointed) h.output = output;
          held[{i, s}] = std::move(h);
          peak = std::max(peak, static_cast<int>(held.size()));
          sample_held();
        } else {
          auto it = held.find({i, s});
          TORCH_CHECK(it != held.end(), "its forward has not run on this device");
          Held h = std::move(it->second);
          held.erase(it);
          at::Tensor grad_output;
          if (s < S - 1) grad_output = to_stage_device(exchange.take_gradient(i, s + 1), device);
          {
            TraceScope scope(tracer, "backward", tracks_[d],
                             {{"micro_batch", static_cast<int64_t>(i)},
                              {"stage", static_cast<int64_t>(s)},
                              {"recomputed", static_cast<int64_t>(h.checkpointed ? 1 : 0)}});
            if (h.checkpointed) {
              torch::AutoGradMode graph(true);
              h.output = stage_forward(i, s, h.input);
              sample_held();  // the rebuilt graph is held until this backward is done
            }
            if (h.output.requires_grad()) {
              if (s == S - 1) {
                torch::autograd::backward({h.output});
              } else {
                torch::autograd::backward({h.output}, {grad_output});
              }
            }
          }
          at::Tensor grad_input;
          if (s > 0) {
            grad_input = h.input.grad();
            if (!grad_input.defined()) grad_input = at::zeros_like(h.input);
          }
          h = Held{};  // the graph and the input go before the previous stage moves on
          if (s > 0) exchange.put_gradient(i, s, std::move(grad_input));
        }
      } catch (const Stopped&) {
        throw;
      } catch (const c10::Error& e) {
        exchange.fail(d);
        throw std::runtime_error(label + ": " + e.what_without_backtrace());
      } catch (const std::exception& e) {
        exchange.fail(d);
        throw std::runtime_error(label + ": " + e.what());
      } catch (...) {
        exchange.fail(d);
        throw;
      }
    }
    result.peak_in_flight[d] = peak;
  };

  for (int d = 0; d < D; ++d) {
    workers_[d]->submit([&run_device, d] { run_device(d); },
                        "pipeline step (schedule " + schedule.name + ", device " + std::to_string(d) + ")");
  }
  std::vector<std::exception_ptr> errors(D);
  for (int d = 0; d < D; ++d) errors[d] = workers_[d]->take();
  const int failed = exchange.failed_device();
  if (failed >= 0 && errors[failed]) std::rethrow_exception(errors[failed]);
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  return result;
}

}  // namespace harness::pipeline
