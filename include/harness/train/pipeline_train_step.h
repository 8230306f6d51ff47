// GPT-2 trained as a pipeline schedule program (run_pipeline's model_parallel and
// pipeline_parallel): the model's blocks are cut into stages by a balance, stage s runs on device
// s % D (interleaving puts V stages on each device), and each step's micro-batches go through a
// ScheduleExecutor. Stage 0 embeds; the last stage applies ln_f, the tied head and SPEC §3's
// weighted cross entropy to its micro-batch, divided by the whole batch's label weight, so that the
// micro-batches' gradients add up to the whole batch's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "harness/device.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/train/train_step.h"

namespace harness::train {

struct PipelineStepOptions {
  std::vector<Device> devices;        // D, the schedule's devices (one worker each)
  std::string schedule = "1f1b";      // "gpipe" | "1f1b" | "interleaved"
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

// The training schedule `name` for M micro-batches on D devices with V stages each. Interleaving
// cannot take M % D != 0 (a short last batch): that step runs GPipe's order over the same stages.
// Throws std::invalid_argument naming --pipeline_schedule / --virtual_stages on an unknown name,
// or V > 1 without interleaving.
pipeline::TrainingSchedule make_training_schedule(const std::string& name, int micro_batches,
                                                  int devices, int virtual_stages);

// The (unsplit) model's parameters and AdamW live as in GPT2TrainStep; what differs is the step.
class PipelineTrainStep : public GPT2TrainStep {
 public:
  // Places the model's blocks by the balance (model->place) and starts the workers. Throws
  // std::invalid_argument, naming the flag, on a bad schedule, balance or device count.
  PipelineTrainStep(model::GPT2LMHeadModel model, const OptimizerSettings& optimizer, PipelineStepOptions options);
  ~PipelineTrainStep() override;

  // Micro-batches: each batch cut into min(M, rows) nearly equal parts (tensor_split), one
  // schedule run per batch (several under gradient accumulation, their gradients summed, every
  // loss over the label weight of all the batches).
  using TrainStep::step;
  double step(const std::vector<data::Batch>& batches) override;
  c10::Device input_device() const override;
  void set_global_step(int64_t global_step) override { global_step_ = global_step; }

  // Half blocks per stage, and as --balance would say it: "2,2", or "2.5,1.5" when a block is cut.
  const std::vector<int>& balance_halves() const { return halves_; }
  std::string balance_text() const;
  int stages() const { return static_cast<int>(halves_.size()); }
  // What the last step ran: its schedule and each device's peak of held forwards.
  const pipeline::TrainingSchedule& last_schedule() const { return last_schedule_; }
  const std::vector<int>& last_peak_in_flight() const { return last_peak_in_flight_; }
  // Each device's peak held activation bytes in the last step (empty unless the activation meter
  // is installed, see activation_meter.h).
  const std::vector<int64_t>& last_peak_held_bytes() const { return last_peak_held_bytes_; }
  pipeline::ScheduleExecutor& executor() { return *executor_; }

 private:
  PipelineStepOptions options_;
  std::vector<int> halves_;
  // Stage s runs block halves [first_unit_of_stage_[s], first_unit_of_stage_[s + 1]) (2b: block b's
  // attention half, 2b + 1 its MLP half): halves_' running sums.
  std::vector<int64_t> first_unit_of_stage_;
  std::unique_ptr<pipeline::ScheduleExecutor> executor_;
  int64_t global_step_ = 0;
  pipeline::TrainingSchedule last_schedule_;
  std::vector<int> last_peak_in_flight_;
  std::vector<int64_t> last_peak_held_bytes_;
  bool told_fallback_ = false;
};

}  // namespace harness::train
