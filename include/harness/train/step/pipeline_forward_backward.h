// GPT-2 cut into pipeline stages and run by a schedule, as a training step's forward-backward part
// (forward_backward.h). The model's blocks are cut into stages by a balance; stage s runs on
// schedule device s % D (interleaving puts V stages on each device), and each batch's
// micro-batches go through the schedule's actions. Stage 0 embeds; the last stage applies ln_f,
// the tied head and SPEC §3's weighted cross entropy to its micro-batch, divided by the whole
// step's label weight, so that the micro-batches' gradients add up to the whole batch's. All of it
// is the model's own arithmetic (embed, forward_units, head_loss); this decides where it runs.
//
// Two placements, one engine (executor.h):
//   - in-process (run_pipeline): the D schedule devices are this process's devices, one worker
//     thread each, tensors handed over in memory; the last stage's head is a leaf copy of wte
//     whose gradient is added to wte's after the step.
//   - processes (run_data_parallel --pipeline_parallel_size P): schedule device p is pipeline rank
//     p, a process of its own; activations and their gradients cross as c10d send/recv
//     (process_transport.h). The first stage's rank holds wte for the embedding and the last
//     stage's its own copy for the head; their gradients are summed over the embedding group
//     after the data-parallel average, as Megatron does, so the two copies stay equal.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/device.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/process_transport.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/train/step/forward_backward.h"

namespace harness::train {

struct PipelineStepOptions {
  // The schedule's devices, one worker each (in-process); with processes, this process's device.
  std::vector<Device> devices;
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::kOneFOneB;
  int virtual_stages = 1;             // V, stages per device (interleaved only may use V > 1)
  int micro_batches = 1;              // M per full batch (--n_chunk; model parallel: 1)
  std::vector<int> balance;           // blocks per stage (D * V entries); empty: default_balance
  // Half blocks per stage instead (an attention half or an MLP half each, in model order), what
  // balance_gpt2_by_time returns; wins over `balance` when given.
  std::vector<int> balance_halves;
  pipeline::ActivationCheckpointing checkpointing = pipeline::ActivationCheckpointing::kNever;
  int threads_per_device = 0;         // 0: the cores shared among the CPU lanes (GPU workers: all)
  uint64_t seed = 0;                  // the dropout streams derive from it and the global step
  Tracer* tracer = nullptr;           // one slice per action when set
};

// The pipeline flags both programs take (SPEC §7.1, §7.2): run_pipeline's in pipeline_parallel
// mode, run_data_parallel's with --pipeline_parallel_size P > 1.
struct PipelineScheduleConfig {
  int64_t n_chunk = 4;                                                  // --n_chunk: micro-batches per batch
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::kOneFOneB;  // --pipeline_schedule
  int virtual_stages = 1;                                               // --virtual_stages
  pipeline::ActivationCheckpointing activation_checkpointing = pipeline::ActivationCheckpointing::kNever;
  pipeline::BalanceSpec balance;  // --balance (pipeline::parse_balance): auto, per stage, or not given
};

// The step options the flags give for `devices` schedule devices: schedule, V and M checked
// (pipeline::check_schedule_flags), a balance given as numbers in balance_halves (its sum is
// checked against the model later); "auto" leaves it empty for the caller to time. Devices, threads,
// seed and tracer are the caller's to fill.
PipelineStepOptions pipeline_step_options(const PipelineScheduleConfig& flags, int devices);

// A pipeline's step options: pipeline_step_options, and where --balance gave no numbers the
// default split, GPT-2 cut by its pieces' estimated costs (pipeline::balance_gpt2_by_cost; under
// zbv pipeline::balance_gpt2_for_zbv) for micro-batches of a replica's `rows` / M x `tokens`; with
// "auto" it stands until the caller's timed split replaces it. `processes`: stages as processes
// (run_data_parallel), for the errors.
// run_pipeline's model_parallel mode keeps SPEC §4's placement and does not call this.
PipelineStepOptions balanced_pipeline_options(const PipelineScheduleConfig& flags, int devices, bool processes,
                                              const model::GPT2Config& config, int64_t rows, int64_t tokens);

// The options' schedule and balance, as pipeline::stage_halves checks them against a model (the
// one check of the stage split: the programs' flag checks and the step's own cut call it).
pipeline::StageSplitFlags stage_split_flags(const PipelineStepOptions& options);
// Where the stage count comes from, for stage_halves' errors: "2 devices x 1 virtual stages"
// in-process, "--pipeline_parallel_size 2 x --virtual_stages 1" with stages as processes.
std::string stages_from(int devices, int virtual_stages, bool processes);

// Pipeline stages that are processes: this process is rank p of `pipeline` (the schedule's
// device p, P = its size > 1). `embedding`: the group of the first and last stage's ranks, on
// those two only.
struct PipelineProcesses {
  data_parallel::DistContext pipeline;
  std::optional<data_parallel::DistContext> embedding;
  // --debug_sync: each exchange recorded in the pipeline group's store, so that a stage that
  // waits in vain says what its peers were waiting for (process_transport.h).
  bool debug_sync = false;
};

// The training schedule of `kind` for M micro-batches on D devices with V stages each. Interleaving
// cannot take M % D != 0 (a short last batch): that step runs GPipe's order over the same stages.
// zbv orders its actions on a clock of `stage_ticks` (pipeline::estimate_gpt2_stage_ticks; unit
// ticks when empty); the other schedules' orders do not depend on costs.
// Throws std::invalid_argument naming --virtual_stages on V > 1 without interleaving.
pipeline::TrainingSchedule make_training_schedule(pipeline::ScheduleKind kind, int micro_batches,
                                                  int devices, int virtual_stages,
                                                  const std::vector<pipeline::ActionTicks>& stage_ticks = {});
// The schedule a pipeline of GPT-2 cut into `halves` (half blocks per stage) runs:
// make_training_schedule, zbv's order on those stages' estimated costs at micro-batches of
// `micro_rows` x `tokens` (pipeline::estimate_gpt2_stage_ticks).
pipeline::TrainingSchedule gpt2_training_schedule(pipeline::ScheduleKind kind, int micro_batches, int devices,
                                                  int virtual_stages, const model::GPT2Config& config,
                                                  const std::vector<int>& halves, int64_t micro_rows, int64_t tokens);

class PipelineForwardBackward final : public ForwardBackward {
 public:
  // In-process: places the model's blocks by the balance (model->place) and starts the workers.
  // Throws std::invalid_argument, naming the flag, on a bad schedule, balance or device count.
  PipelineForwardBackward(model::GPT2LMHeadModel model, PipelineStepOptions options);
  // Processes: the model stays where it is (options.devices: this process's one device); only
  // this rank's stages run here.
  PipelineForwardBackward(model::GPT2LMHeadModel model, PipelineStepOptions options, PipelineProcesses processes);
  ~PipelineForwardBackward() override;

  // Micro-batches: the batch cut into min(M, rows) nearly equal parts (tensor_split), one
  // schedule run per batch.
  at::Tensor run(const data::Batch& batch, const at::Tensor& weight_sum, int64_t k,
                 model::Precision precision) override;
  void finish_gradients() override;
  double step_loss(const at::Tensor& local) override;
  // The batch's micro-batches, min(M, rows): each of this process's stages accumulates its
  // parameters' gradients once in each micro-batch's backward (wte, on the first and the last
  // stage's ranks, once on each).
  int64_t gradient_accumulations(const data::Batch& batch) const override;
  c10::Device input_device() const override { return options_.devices.front().torch_device(); }
  c10::Device loss_device() const override;
  void set_global_step(int64_t global_step) override { global_step_ = global_step; }
  // Processes: evaluation through the stages, forward only, one batch (or one new token) at a
  // time down the chain of stages, the result sent from the last stage to every stage; each stage
  // keeps its own layers' KV cache in generation. In-process: nullopt (the model is whole here).
  std::optional<double> validation_loss(data::BatchLoader& loader) override;
  std::optional<std::vector<std::string>> generate(const data::Tokenizer& tokenizer,
                                                   const std::vector<data::TranslationExample>& examples,
                                                   int64_t model_max_length, bool show_progress) override;

  // Half blocks per stage, and as --balance would say it: "2,2", or "2.5,1.5" when a block is cut.
  const std::vector<int>& balance_halves() const { return halves_; }
  std::string balance_text() const;
  int stages() const { return static_cast<int>(halves_.size()); }
  // Stage s runs block halves [first_unit_of_stage()[s], first_unit_of_stage()[s + 1]).
  const std::vector<int64_t>& first_unit_of_stage() const { return first_unit_of_stage_; }
  // Schedule devices (D, or P with processes), and this process's (0 in-process, where it runs all).
  int schedule_devices() const;
  // The schedule device that runs stage s: s % D, or the V of zbv (stages s and 2D - 1 - s on
  // device s), where the first device holds the last stage too.
  int device_of_stage(int s) const;
  // The Hugging Face names of the parameters this process's stages use (every one in-process).
  std::vector<std::string> held_parameters() const;
  // Which schedule device's stage owns `name` (wte: the first stage's).
  int owner_of(const std::string& name) const;
  // Processes: where the first and last stages keep the tied wte's gradient, once averaged over
  // their data-parallel group, for the embedding group's sum: wte's .grad() unless set; ZeRO's
  // chunk of it when set (the same elements on both stages: a bucket or a unit of its own), for a
  // synchronizer built over what the stages hold.
  void set_tied_gradient(std::function<at::Tensor()> tied_gradient);
  // What the last run ran: its schedule and each device's peak of held forwards (this process's
  // only, with processes).
  const pipeline::TrainingSchedule& last_schedule() const { return last_schedule_; }
  const std::vector<int>& last_peak_in_flight() const { return last_peak_in_flight_; }
  // Each device's peak held activation bytes in the last run (empty unless the activation meter
  // is installed, see activation_meter.h).
  const std::vector<int64_t>& last_peak_held_bytes() const { return last_peak_held_bytes_; }
  // In-process only.
  pipeline::ScheduleExecutor& executor();

 private:
  void cut_into_stages(int schedule_devices);
  // Processes: `ids` [B, T] through this rank's stages in model order, each stage's input received
  // from the one before and its output sent to the one after; returns the last stage's hidden
  // states on the last stage's rank (undefined on the others). With `cache`, generation's
  // positions continue after it.
  at::Tensor forward_through_stages(const at::Tensor& ids, model::KVCache* cache);
  // `value` (a scalar, the last stage's) on every rank of the pipeline group.
  at::Tensor from_last_stage(at::Tensor value);
  // The schedule of a batch of `rows` x `tokens` (zbv's order depends on its micro-batches' shape).
  pipeline::TrainingSchedule schedule_for(int64_t rows, int64_t tokens);

  model::GPT2LMHeadModel model_;
  PipelineStepOptions options_;
  std::optional<PipelineProcesses> processes_;
  std::function<at::Tensor()> tied_gradient_;  // set_tied_gradient's
  std::vector<int> halves_;
  // halves_' running sums: stage s runs block halves [first_unit_of_stage_[s], first_unit_of_stage_[s + 1])
  // (2b: block b's attention half, 2b + 1 its MLP half).
  std::vector<int64_t> first_unit_of_stage_;
  std::unique_ptr<pipeline::ScheduleExecutor> executor_;  // in-process
  // Processes: the send/recv transport, and the rows of the current batch's micro-batches and its
  // tokens, from which it sizes what it receives.
  std::unique_ptr<pipeline::ProcessTransport> transport_;
  std::vector<int64_t> rows_;
  int64_t tokens_ = 0;
  // With sequence parallelism the stages pass each tensor rank's part of a micro-batch (training,
  // validation); the cached path (generation) passes whole ones.
  bool split_messages_ = true;
  std::vector<int64_t> message_shape(int micro_batch) const;
  at::Tensor head_weight_;  // in-process: the tied head's leaf, from micro-step 0 of each step
  int64_t global_step_ = 0;
  pipeline::TrainingSchedule last_schedule_;
  std::vector<int> last_peak_in_flight_;
  std::vector<int64_t> last_peak_held_bytes_;
  bool told_fallback_ = false;
};

}  // namespace harness::train
