// The schedule executor (see executor.h).
#include "harness/pipeline/executor.h"

#include <torch/torch.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "harness/model/dropout.h"
#include "harness/model/weight_grad_store.h"
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

// The in-process transport of one step: the tensors crossing stages, handed from worker to worker,
// and the stop signal. A send is handed over at once; a receive is waited for when the action
// needs it, so that a worker never waits before it has to.
class InProcessTransport final : public StageTransport {
 public:
  InProcessTransport(int micro_batches, int stages)
      : activations_(micro_batches, std::vector<Slot>(stages)),
        gradients_(micro_batches, std::vector<Slot>(stages)) {}

  void exchange(int device, const std::vector<P2POp>& ops,
                const std::function<at::Tensor(const P2PMessage&)>& outgoing) override {
    for (const P2POp& op : ops) {
      if (op.kind == P2POp::Kind::kSend) put(slot_of(op.message), outgoing(op.message));
    }
  }
  at::Tensor take(int device, const P2PMessage& message) override { return take(slot_of(message)); }

  // The first failing device; later ones (and the waiters it wakes) are not the cause.
  void fail(int device) override {
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
  // activations_[i][s]: the output of forward (i, s) for stage s + 1; gradients_[i][s]: the
  // gradient of forward (i, s)'s input for stage s - 1.
  Slot& slot_of(const P2PMessage& m) {
    return (m.kind == P2PMessage::Kind::kActivation ? activations_ : gradients_)[m.micro_batch][m.from_stage];
  }
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

const P2PPlan& cached_p2p_plan(const TrainingSchedule& schedule) {
  static std::mutex mutex;
  static std::map<std::tuple<std::string, int, int, int>, std::vector<std::unique_ptr<P2PPlan>>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto& made = plans[{schedule.name, schedule.micro_batches, schedule.devices, schedule.virtual_stages}];
  for (const auto& plan : made) {
    if (plan->schedule.per_device == schedule.per_device) return *plan;
  }
  auto plan = std::make_unique<P2PPlan>(make_p2p_plan(schedule));  // validates the schedule
  validate_p2p_plan(*plan);  // every send meets its receive, with no cycle of waits
  made.push_back(std::move(plan));
  return *made.back();
}

struct HeldForwards {
  // What a forward leaves for its backward: its input and, unless checkpointed, its output.
  struct Held {
    at::Tensor input, output;  // output undefined when checkpointed
    bool checkpointed = false;
  };
  std::map<std::pair<int, int>, Held> by_task;  // (micro-batch, stage) -> what its backward needs
};

StageEnds::StageEnds(int micro_batches, int devices)
    : inputs(micro_batches), outputs(micro_batches), grad_outputs(micro_batches), grad_inputs(micro_batches) {
  for (int d = 0; d < devices; ++d) held.push_back(std::make_shared<HeldForwards>());
}

namespace {

// One device's part of a step: its steps of the plan, in order (run). Forwards hand their output
// to the next stage, backwards their input's gradient to the previous one, through `transport`
// (or `local`, when that stage is on this device too); a split backward's W runs the weight
// gradients its B deferred. With `ends`, the pipeline is one part of a larger graph: the first
// stage's inputs and the last stage's outputs are the caller's.
class DeviceSteps {
 public:
  DeviceSteps(const P2PPlan& plan, int d, const Device& device, const StageForward& forward, uint64_t step_seed,
              StageTransport& transport, const ExecutorOptions& options, const std::string& track, StageEnds* ends)
      : plan_(plan),
        schedule_(plan.schedule),
        S_(schedule_.stages()),
        d_(d),
        device_(device),
        torch_device_(device.torch_device()),
        forward_(forward),
        step_seed_(step_seed),
        transport_(transport),
        options_(options),
        track_(track),
        ends_(checked(ends, plan.schedule)),
        keep_graph_(ends != nullptr && ends->keep_graph),
        metered_(activation_meter_installed()),
        live_before_(metered_ ? activation_live_bytes(d + 1)[d] : 0),
        checkpointed_(checkpoint_plan(schedule_, options.checkpointing)),
        held_((ends != nullptr ? *ends->held[d] : own_).by_task) {
    result_.losses.resize(schedule_.micro_batches);
  }

  DeviceStepResult run() {
    size_t k = 0;  // the k-th compute action of this device (for the checkpoint plan)
    for (const P2PStep& step : plan_.per_device[d_]) {
      std::string label;
      try {
        if (step.is_exchange()) {
          label = "exchange " + p2p_exchange_label(step.exchange);
          exchange(step.exchange);
          continue;
        }
        const Action& action = step.action;
        const int i = action.micro_batch, s = action.stage;
        static const char* const kWords[] = {"forward", "backward", "weight-gradient pass"};
        label = kWords[static_cast<int>(action.kind)] + std::string(" of micro-batch ") + std::to_string(i) + ", " +
                options_.stage_word + " " + std::to_string(s);
        const Tracer::Args task = {{"micro_batch", static_cast<int64_t>(i)},
                                   {options_.stage_word, static_cast<int64_t>(s)}};
        const size_t position = k++;
        switch (action.kind) {
          case Action::Kind::kForward: forward(i, s, task, checkpointed_[d_][position]); break;
          case Action::Kind::kBackward: backward(i, s, task); break;
          case Action::Kind::kWeight: weight_gradients(i, s, task); break;
        }
      } catch (const Stopped&) {
        throw;
      } catch (const c10::Error& e) {
        transport_.fail(d_);
        throw StageActionError(label, e.what_without_backtrace());
      } catch (const std::exception& e) {
        transport_.fail(d_);
        throw StageActionError(label, e.what());
      } catch (...) {
        transport_.fail(d_);
        throw;
      }
    }
    try {
      transport_.finish(d_);
    } catch (const c10::Error& e) {
      throw StageActionError("the step's last sends", e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw StageActionError("the step's last sends", e.what());
    }
    return std::move(result_);
  }

 private:
  using Held = HeldForwards::Held;

  // `ends`, checked to be for the plan's micro-batches and devices before anything reads them.
  static StageEnds* checked(StageEnds* ends, const TrainingSchedule& schedule) {
    const int D = schedule.devices, M = schedule.micro_batches;
    if (ends != nullptr) {
      TORCH_CHECK(static_cast<int>(ends->inputs.size()) == M && static_cast<int>(ends->held.size()) == D,
                  "run_device_steps: the pipeline's ends are for ", ends->inputs.size(), " micro-batches and ",
                  ends->held.size(), " devices, the plan has ", M, " and ", D);
    }
    return ends;
  }

  using Key = std::tuple<int, int, int>;  // a message's kind, micro-batch and sending stage

  static Key key(const P2PMessage& m) { return {static_cast<int>(m.kind), m.micro_batch, m.from_stage}; }

  void hand_over(const P2PMessage& m, int to_stage, at::Tensor t) {
    (schedule_.device_of(to_stage) == d_ ? local_ : outbox_)[key(m)] = std::move(t);
  }

  at::Tensor receive(const P2PMessage& m) {
    auto it = local_.find(key(m));
    if (it == local_.end()) return to_stage_device(transport_.take(d_, m), device_);
    at::Tensor t = std::move(it->second);
    local_.erase(it);
    return t;
  }

  void exchange(const std::vector<P2POp>& ops) {
    transport_.exchange(d_, ops, [&](const P2PMessage& m) {
      auto it = outbox_.find(key(m));
      TORCH_CHECK(it != outbox_.end(), "the plan sends ", p2p_message_label(m), " before the action that makes it ran");
      at::Tensor t = std::move(it->second);
      outbox_.erase(it);
      return t;
    });
  }

  // Stage s's forward of micro-batch i, with its own dropout stream (and, split, its deferral).
  at::Tensor stage_forward(int i, int s, const at::Tensor& input) {
    ActivationScope charged(d_);  // counted only when the benchmarks installed the meter
    std::optional<model::DeferWeightGradients> defer;
    if (schedule_.split_backward) defer.emplace(&deferred_[{i, s}]);
    const uint64_t seed = stage_stream_seed(step_seed_, i, s);
    if (device_.is_cuda()) {
      return model::with_default_generator_seeded(torch_device_, seed, [&] { return forward_(i, s, input); });
    }
    model::DropoutGeneratorScope stream(model::make_generator(torch_device_, seed));
    return forward_(i, s, input);
  }

  void sample_held() {
    if (!metered_) return;
    result_.peak_held_bytes = std::max(result_.peak_held_bytes, activation_live_bytes(d_ + 1)[d_] - live_before_);
  }

  void forward(int i, int s, const Tracer::Args& task, bool checkpointed) {
    at::Tensor input;
    if (s > 0 || ends_ != nullptr) {
      input = s > 0 ? receive({P2PMessage::Kind::kActivation, i, s - 1}) : to_stage_device(ends_->inputs[i], device_);
    }
    if (input.defined() && !keep_graph_) {
      // Cut the graph here: this stage's backward is an action of its own.
      const bool wants_grad = s > 0 || input.requires_grad();
      input = input.detach();
      if (metered_ && device_.is_cpu()) {  // charge the held input to this device (see StepResult)
        ActivationScope charged(d_);
        input = input.clone();
      }
      if (wants_grad && input.is_floating_point()) input.requires_grad_(true);
    }
    Held h;
    h.checkpointed = checkpointed;
    at::Tensor output;
    {
      TraceScope scope(options_.tracer, "forward", track_, task);
      // Kept whole, the graph is the caller's, under the caller's grad mode.
      std::optional<torch::AutoGradMode> graph;
      if (!keep_graph_) graph.emplace(!h.checkpointed);
      output = stage_forward(i, s, input);
    }
    TORCH_CHECK(output.defined(), "the stage returned an undefined tensor");
    if (s == S_ - 1 && ends_ != nullptr) {
      ends_->outputs[i] = keep_graph_ ? output : output.detach();
    } else if (s == S_ - 1) {
      TORCH_CHECK(output.numel() == 1, "the last stage must return a scalar loss, got shape ", output.sizes());
      TORCH_CHECK(h.checkpointed || output.requires_grad(), "the last stage's loss does not require grad: nothing to train");
      result_.losses[i] = output.detach();
    } else {
      hand_over({P2PMessage::Kind::kActivation, i, s}, s + 1, keep_graph_ ? output : output.detach());
    }
    if (!keep_graph_) {
      h.input = input;
      if (!h.checkpointed) h.output = output;
      held_[{i, s}] = std::move(h);
    }
    // Split, a pair stays in flight from its forward to its W (its layers' inputs wait for it).
    result_.peak_in_flight = std::max(result_.peak_in_flight,
                                      static_cast<int>(schedule_.split_backward ? deferred_.size() : held_.size()));
    sample_held();
  }

  void backward(int i, int s, const Tracer::Args& task) {
    TORCH_CHECK(!keep_graph_, "a backward action with the graph kept whole (the autograd engine runs it)");
    auto it = held_.find({i, s});
    TORCH_CHECK(it != held_.end(), "its forward has not run on this device");
    Held h = std::move(it->second);
    held_.erase(it);
    at::Tensor grad_output;
    if (s < S_ - 1) {
      grad_output = receive({P2PMessage::Kind::kGradient, i, s + 1});
    } else if (ends_ != nullptr && ends_->grad_outputs[i].defined()) {
      grad_output = to_stage_device(ends_->grad_outputs[i], device_);
    }
    {
      Tracer::Args args = task;
      args.emplace_back("recomputed", static_cast<int64_t>(h.checkpointed ? 1 : 0));
      TraceScope scope(options_.tracer, "backward", track_, args);
      if (h.checkpointed) {
        torch::AutoGradMode graph(true);
        h.output = stage_forward(i, s, h.input);
        sample_held();  // the rebuilt graph is held until this backward is done
      }
      if (h.output.requires_grad()) {
        if (s == S_ - 1 && ends_ == nullptr) {
          torch::autograd::backward({h.output});
        } else if (grad_output.defined()) {
          torch::autograd::backward({h.output}, {grad_output});
        }
      }
    }
    at::Tensor grad_input;
    if (s > 0) {
      grad_input = h.input.grad();
      if (!grad_input.defined()) grad_input = at::zeros_like(h.input);
    } else if (ends_ != nullptr && h.input.defined() && h.input.requires_grad()) {
      ends_->grad_inputs[i] = h.input.grad();
    }
    h = Held{};  // the graph and the input go before the previous stage moves on
    if (s > 0) hand_over({P2PMessage::Kind::kGradient, i, s}, s - 1, std::move(grad_input));
  }

  // A split backward's W: the weight-gradient products (micro-batch i, stage s)'s B deferred.
  void weight_gradients(int i, int s, const Tracer::Args& task) {
    auto it = deferred_.find({i, s});
    TORCH_CHECK(it != deferred_.end(), "its forward has not run on this device");
    {
      TraceScope scope(options_.tracer, "weight", track_, task);
      it->second.flush();
    }
    deferred_.erase(it);
  }

  const P2PPlan& plan_;
  const TrainingSchedule& schedule_;
  const int S_;
  const int d_;
  const Device& device_;
  const c10::Device torch_device_;
  const StageForward& forward_;
  const uint64_t step_seed_;
  StageTransport& transport_;
  const ExecutorOptions& options_;
  const std::string& track_;
  StageEnds* const ends_;
  const bool keep_graph_;
  const bool metered_;
  const int64_t live_before_;
  const std::vector<std::vector<bool>> checkpointed_;
  HeldForwards own_;
  std::map<std::pair<int, int>, Held>& held_;  // (micro-batch, stage) -> what its backward needs
  // Tensors for this device's later stages (V > 1 on one device), and those waiting for the next
  // exchange's sends.
  std::map<Key, at::Tensor> local_, outbox_;
  // With a split backward (zero-bubble schedules) each (micro-batch, stage) keeps the
  // weight-gradient products its B deferred until its W runs them; its forward (and a
  // recomputation) says where.
  std::map<std::pair<int, int>, model::WeightGradStore> deferred_;
  DeviceStepResult result_;
};

DeviceStepResult run_steps(const P2PPlan& plan, int d, const Device& device, const StageForward& forward,
                           uint64_t step_seed, StageTransport& transport, const ExecutorOptions& options,
                           const std::string& track, StageEnds* ends) {
  return DeviceSteps(plan, d, device, forward, step_seed, transport, options, track, ends).run();
}

}  // namespace

DeviceStepResult run_device_steps(const P2PPlan& plan, int d, const Device& device, const StageForward& forward,
                                  uint64_t step_seed, StageTransport& transport, const ExecutorOptions& options,
                                  const std::string& track) {
  return run_steps(plan, d, device, forward, step_seed, transport, options, track, nullptr);
}

DeviceStepResult run_device_steps(const P2PPlan& plan, int d, const Device& device, const StageForward& forward,
                                  uint64_t step_seed, StageTransport& transport, const ExecutorOptions& options,
                                  const std::string& track, StageEnds& ends) {
  return run_steps(plan, d, device, forward, step_seed, transport, options, track, &ends);
}

StepResult ScheduleExecutor::run(const TrainingSchedule& schedule, const StageForward& forward,
                                 uint64_t step_seed) {
  validate_schedule(schedule);
  if (schedule.devices != static_cast<int>(devices_.size())) {
    throw std::invalid_argument("ScheduleExecutor: schedule '" + schedule.name + "' is for " +
                                std::to_string(schedule.devices) + " devices, the executor has " +
                                std::to_string(devices_.size()));
  }
  return run_plan(cached_p2p_plan(schedule), forward, step_seed);
}

StepResult ScheduleExecutor::run_plan(const P2PPlan& plan, const StageForward& forward, uint64_t step_seed,
                                      StageEnds* ends) {
  const TrainingSchedule& schedule = plan.schedule;
  const int D = schedule.devices, M = schedule.micro_batches, S = schedule.stages();
  if (D != static_cast<int>(devices_.size()) || plan.per_device.size() != devices_.size()) {
    throw std::invalid_argument("ScheduleExecutor: the plan of schedule '" + schedule.name + "' is for " +
                                std::to_string(plan.per_device.size()) + " devices, the executor has " +
                                std::to_string(devices_.size()));
  }
  TORCH_CHECK(static_cast<bool>(forward), "ScheduleExecutor::run: empty stage forward");

  InProcessTransport transport(M, S);
  std::vector<DeviceStepResult> parts(D);
  std::vector<std::exception_ptr> errors(D);
  for (int d = 0; d < D; ++d) {
    workers_[d]->submit(
        [&, d] {
          try {
            parts[d] = run_steps(plan, d, devices_[d], forward, step_seed, transport, options_, tracks_[d], ends);
          } catch (const StageActionError& e) {  // named with its device; other failures the worker names
            errors[d] = std::make_exception_ptr(
                std::runtime_error(e.action + " on " + tracks_[d] + " failed: " + e.reason));
          }
        },
        "pipeline step (schedule " + schedule.name + ", device " + std::to_string(d) + ")");
  }
  for (int d = 0; d < D; ++d) {
    std::exception_ptr error = workers_[d]->take();
    if (error) errors[d] = error;
  }
  const int failed = transport.failed_device();
  if (failed >= 0 && errors[failed]) std::rethrow_exception(errors[failed]);
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  StepResult result;
  result.losses.resize(M);
  for (int d = 0; d < D; ++d) {
    for (int i = 0; i < M; ++i) {
      if (parts[d].losses[i].defined()) result.losses[i] = parts[d].losses[i];
    }
    result.peak_in_flight.push_back(parts[d].peak_in_flight);
    if (activation_meter_installed()) result.peak_held_bytes.push_back(parts[d].peak_held_bytes);
  }
  return result;
}

}  // namespace harness::pipeline
