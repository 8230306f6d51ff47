// The pipeline's training executor: runs a TrainingSchedule (training_schedule.h) for one step.
// One loop runs a device's part: it walks the device's steps of the schedule's P2PPlan
// (p2p_plan.h), its compute actions and its exchanges, and leaves the carrying of tensors between
// devices to a StageTransport, so the same schedule data and the same loop drive run_pipeline's
// worker threads (ScheduleExecutor: one thread per device, tensors handed over in memory), the
// a5_2_2 Pipe (GPipe's step in two halves, gpipe_plan.h, its ends the Pipe's tensors) and
// pipeline stages that are processes (run_device_steps with c10d send/recv,
// process_transport.h), as Megatron keeps p2p_communication apart from its schedules. Every
// backward is an explicit torch::autograd::backward called by the worker that owns the stage, so
// no autograd engine thread ever waits for a worker (on GPUs the engine runs a device's nodes on
// that device's one engine thread; a node that blocked there would deadlock the workers' own
// backward calls queued behind it). What a stage computes is the caller's (StageForward); the
// executor owns the order, the hand-offs, recomputation and the random streams.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "harness/device.h"
#include "harness/pipeline/p2p_plan.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/trace.h"

namespace harness::pipeline {

class Worker;

// torchgpipe's activation checkpointing: keep no graph for a checkpointed (micro-batch, stage)
// during the forward, only its input, and run its forward again, with the same random stream,
// right before its backward. kExceptLast spares what recomputing would not save: a forward whose
// backward is the device's very next action (in GPipe the last micro-batch, torchgpipe's meaning;
// in 1F1B every forward of the last device).
enum class ActivationCheckpointing { kNever, kExceptLast, kAlways };

// "always" | "except_last" | "never"; throws std::invalid_argument naming
// --activation_checkpointing and the value.
ActivationCheckpointing parse_activation_checkpointing(const std::string& text);
std::string to_string(ActivationCheckpointing mode);
// [device][k]: whether the k-th action of the device, a forward, is checkpointed under `mode`
// (false for backwards).
std::vector<std::vector<bool>> checkpoint_plan(const TrainingSchedule& schedule, ActivationCheckpointing mode);

// The forward of `stage` on `micro_batch`, run by the stage's worker. `input` is undefined for
// stage 0 (with StageEnds: the micro-batch's input); otherwise it is the previous stage's output
// moved to this stage's device, a leaf that requires grad (with StageEnds that keep the graph: the
// moved output itself). Returns the stage's output, which the next stage receives; the last stage
// returns its micro-batch's share of the loss, a scalar the executor runs backward from (with
// StageEnds: any output). It runs with grad mode on (with StageEnds that keep the graph: the
// caller's grad mode). While it runs, the (step, micro-batch, stage) random stream is the thread's dropout
// stream on a CPU lane and the default generator of a GPU (dropout.h), so a recomputation draws
// the same masks and concurrent stages never share a generator.
using StageForward = std::function<at::Tensor(int micro_batch, int stage, const at::Tensor& input)>;

struct ExecutorOptions {
  // Intra-op threads of each worker; 0: default_threads_per_device(number of CPU lanes).
  int threads_per_device = 0;
  ActivationCheckpointing checkpointing = ActivationCheckpointing::kNever;
  // One slice per action ("forward", "backward"; a recomputation is part of its backward, with
  // arg recomputed = 1), track = the device's name, args micro_batch and stage. Not owned.
  Tracer* tracer = nullptr;
  // What traces and error messages call a stage: "forward of micro-batch 2, stage 1". The Pipe
  // says "partition", GPipe's word.
  std::string stage_word = "stage";
};

// What run_device_steps throws when one of its actions fails: what() is "<action>: <reason>",
// e.g. "forward of micro-batch 2, stage 1: boom", so that an executor can name the device too.
struct StageActionError : std::runtime_error {
  StageActionError(std::string action_, std::string reason_)
      : std::runtime_error(action_ + ": " + reason_), action(std::move(action_)), reason(std::move(reason_)) {}
  std::string action;  // "forward of micro-batch 2, stage 1"
  std::string reason;
};

struct HeldForwards;  // executor.cpp: one device's forwards kept for their backwards

// The two ends of a pipeline that is one part of a model (the Pipe) instead of a whole step from
// the data to a loss. Stage 0's forward takes inputs[i] (moved to its device); the last stage's
// forward leaves its output in outputs[i]; a backward of the last stage starts from
// grad_outputs[i] (undefined: no gradient reaches it) and stage 0's leaves the gradient of its
// input in grad_inputs[i] (undefined when inputs[i] does not require grad). A step may then run
// as two plans (split_at_first_backward, gpipe_plan.h): the forwards now, the backwards later, the
// held forwards kept here in between.
struct StageEnds {
  StageEnds(int micro_batches, int devices);
  std::vector<at::Tensor> inputs, outputs, grad_outputs, grad_inputs;  // [micro-batch]
  // Hand every stage's output on with its autograd graph (not detached), so that the autograd
  // engine runs the whole backward from the caller's loss; a plan with backwards is refused then.
  bool keep_graph = false;
  std::vector<std::shared_ptr<HeldForwards>> held;  // [device]
};

struct StepResult {
  std::vector<at::Tensor> losses;   // [micro-batch] the last stage's outputs, detached
  std::vector<int> peak_in_flight;  // [device] most (micro-batch, stage) forwards held at once
  // [device] With the activation meter installed (activation_meter.h), the most bytes the
  // device's forwards (and recomputations) had allocated and not yet freed, sampled as each
  // returns: what its held activations take, without a forward's own temporaries. A stage input
  // received from a CPU lane is copied first then, so it is charged to the device that holds it,
  // as a real transfer would be. Empty without the meter.
  std::vector<int64_t> peak_held_bytes;
};

// The seed of one step's streams from the run's --seed and the global step, and of one
// (micro-batch, stage) stream within the step (splitmix64 mixing: neighbouring steps, micro-batches
// and stages get unrelated streams). A resumed run recomputes them from the step number alone.
uint64_t step_stream_seed(uint64_t seed, int64_t global_step);
uint64_t stage_stream_seed(uint64_t step_seed, int micro_batch, int stage);

// How tensors cross from a stage on one device to a stage on another. The executor's loop calls
// exchange() at each exchange step of the device's plan and take() when a compute action needs a
// message's tensor (received in an earlier exchange of the plan). Threads and processes differ
// only here.
class StageTransport {
 public:
  virtual ~StageTransport() = default;
  // One exchange group of `device`'s plan, in the plan's order: each send carries
  // `outgoing(message)`; each receive's tensor becomes available to take(). Returns once the
  // group's sends and receives have completed (in-process: once the sends are handed over).
  virtual void exchange(int device, const std::vector<P2POp>& ops,
                        const std::function<at::Tensor(const P2PMessage&)>& outgoing) = 0;
  // The tensor of `message`, received by `device` (waiting for it where the transport receives
  // lazily). Each message is taken once.
  virtual at::Tensor take(int device, const P2PMessage& message) = 0;
  // `device` has run the last step of its plan: sends still in flight complete before this
  // returns, so that a transport may let a send go on while the device computes.
  virtual void finish(int device) {}
  // `device` failed: whoever waits for it stops waiting (in-process; processes learn it from the
  // broken connection).
  virtual void fail(int device) {}
};

// What one device's part of a step left: the losses of the last stage's micro-batches it ran
// (indexed by micro-batch, undefined for others), its peak of held forwards and, with the meter
// installed, of held activation bytes (see StepResult).
struct DeviceStepResult {
  std::vector<at::Tensor> losses;
  int peak_in_flight = 0;
  int64_t peak_held_bytes = 0;
};

// Runs device `device_index`'s steps of `plan` on the calling thread, on `device`, tensors between
// devices going through `transport`: the body of every ScheduleExecutor worker, and the whole of a
// pipeline stage that is a process. An action that fails tells the transport, and is rethrown
// naming the action. `track` names the trace track.
DeviceStepResult run_device_steps(const P2PPlan& plan, int device_index, const Device& device,
                                  const StageForward& forward, uint64_t step_seed, StageTransport& transport,
                                  const ExecutorOptions& options, const std::string& track);
// The same with the pipeline's ends given (StageEnds): `ends` is read and written by every device's
// call of one run, each for its own stages.
DeviceStepResult run_device_steps(const P2PPlan& plan, int device_index, const Device& device,
                                  const StageForward& forward, uint64_t step_seed, StageTransport& transport,
                                  const ExecutorOptions& options, const std::string& track, StageEnds& ends);

// The plan the executor runs for `schedule`, made once per schedule and kept (a zbv order also
// depends on its stages' costs, so one name, M, D and V may have several).
const P2PPlan& cached_p2p_plan(const TrainingSchedule& schedule);

class ScheduleExecutor {
 public:
  // devices[d] runs schedule device d. One worker per entry, so one Device may appear twice (two
  // lanes sharing one GPU). Throws std::invalid_argument on an empty list or bad options.
  ScheduleExecutor(std::vector<Device> devices, ExecutorOptions options = {});
  ~ScheduleExecutor();  // joins the workers
  ScheduleExecutor(const ScheduleExecutor&) = delete;
  ScheduleExecutor& operator=(const ScheduleExecutor&) = delete;

  // Runs one training step: validates the schedule (its device count must match), then every
  // device's actions concurrently, then returns once all of them finished. Parameters' gradients
  // accumulate where the stages' backward leaves them. When an action fails, the other workers
  // stop waiting at once and this rethrows the failure, naming the action and device; the
  // executor stays usable.
  StepResult run(const TrainingSchedule& schedule, const StageForward& forward, uint64_t step_seed);

  // Runs `plan` as run does its schedule's plan, on the in-process transport: a plan of
  // cached_p2p_plan, or one half of a step (gpipe_plan.h) with the pipeline's ends in `ends`
  // (nullptr: the plan ends in a loss). Throws std::invalid_argument when the plan is for another
  // number of devices. A failure reads "<action> on <device> failed: <reason>".
  StepResult run_plan(const P2PPlan& plan, const StageForward& forward, uint64_t step_seed,
                      StageEnds* ends = nullptr);

  const std::vector<Device>& devices() const { return devices_; }
  int threads_per_device() const { return threads_per_device_; }
  const ExecutorOptions& options() const { return options_; }
  void set_checkpointing(ActivationCheckpointing mode) { options_.checkpointing = mode; }

 private:
  std::vector<Device> devices_;
  ExecutorOptions options_;
  int threads_per_device_ = 1;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::string> tracks_;  // trace track per device ("cpu:1", or "cuda:0#1" if shared)
};

}  // namespace harness::pipeline
