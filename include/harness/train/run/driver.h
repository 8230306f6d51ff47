// The training driver both programs call: epochs of optimizer steps (train_step.h), evaluation,
// SPEC §7's printed lines and files, the final model, and checkpoints written atomically and
// resumed from bit-exactly. The programs parse flags into these structs; everything else is here.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/data/example.h"
#include "harness/data/loader.h"
#include "harness/data/tokenizer.h"
#include "harness/train/lr_schedule.h"
#include "harness/train/run/metrics_log.h"
#include "harness/train/plan/plan.h"
#include "harness/train/run/report.h"
#include "harness/train/step/train_step.h"

namespace harness {
class Tracer;
}
namespace harness::data_parallel {
struct DistContext;
}

namespace harness::train {

struct CheckpointOptions {
  int64_t every = 0;             // optimizer steps between checkpoints; 0: at each epoch's end only
  std::string dir;               // empty: <workdir>/checkpoints
  int keep = 2;                  // complete checkpoints kept
  std::string resume = "none";   // none | auto (newest complete in dir) | a checkpoint folder
};

// What a real training run adds to the original's loop, all off by default: a learning-rate
// schedule over the run's optimizer steps, a budget of steps, evaluation every N steps, the
// metrics in TensorBoard's format, and checkpoints written in the background.
struct TrainingControls {
  LrSchedule lr_schedule;  // constant without warmup: AdamW keeps --learning_rate throughout
  int64_t max_steps = 0;   // optimizer steps of the run; 0: the epochs decide
  int64_t eval_every = 0;  // validation loss every N optimizer steps; 0: at each epoch's end only
  std::string tensorboard_dir;  // the metrics as TensorBoard event files too; empty: not
  // Checkpoints copied into host memory at the step and written by a background thread while
  // training goes on (the next copy waits for the previous write).
  bool async_checkpoint = false;
};

// Which of SPEC §7's line and file formats: "Epoch e on Rank r: ..." and rank{r}_*.json with the
// mean per-batch token rate, or "Epoch e: ..." and eval_results/gen_epoch*.json with the epoch's
// tokens over its time.
enum class ReportStyle { kDataParallel, kPipeline };

struct TrainingOptions {
  std::string program;             // "run_data_parallel" | "run_pipeline" (manifest, messages)
  ReportStyle style = ReportStyle::kPipeline;
  int rank = 0;                    // this process's rank in the world
  // The run's plan (plan/plan.h; run_pipeline's: one process), which checkpoints record: their
  // weights and optimizer state are resumed as they are under the same world and tensor split.
  Plan plan;
  // Whether this process prints the per-epoch and summary lines and writes the per-epoch files,
  // and the rank they name ("Epoch e on Rank r", rank{r}_*.json). With tensor parallelism the
  // ranks of one tensor-parallel group train the same replica: only its tensor rank 0 reports,
  // as its data-parallel rank, so that a sum over the printed ranks counts every token once.
  bool reports = true;
  int report_rank = 0;
  std::vector<std::string> pipeline_devices;  // the manifest's record of run_pipeline's devices
  std::vector<c10::Device> devices;           // whose generators checkpoints keep (besides the CPU's)

  int64_t n_epochs = 1;
  int64_t max_batches = 0;         // batches per epoch, 0: all
  int64_t gradient_accumulation_steps = 1;  // batches per optimizer step (the last of an epoch may have fewer)
  int64_t global_batch_size = 0;   // checked on resume: batch positions mean nothing otherwise
  int64_t model_max_length = 128;
  bool benchmark_only = false;
  bool show_progress = true;
  uint64_t seed = 1234;
  std::string data_order;          // how the training order is drawn (recorded, checked on resume)
  double learning_rate = 1e-4;     // the schedule's peak (the step's optimizer starts at it)
  TrainingControls controls;

  std::string workdir;             // results files, and metrics.jsonl where reports && report_rank == 0
  std::string save_dir;            // where the final model goes; empty: not saved by this rank
  std::string tokenizer_path;      // the run's tokenizer.model (copied into checkpoints)
  CheckpointOptions checkpoint;

  Tracer* tracer = nullptr;
  std::string trace_track = "main";

  // --elastic (train/elastic/elastic_step.h): the world passed to run_training is the current
  // generation's and may shrink between steps. Its rank 0 at the time writes the checkpoints and
  // the final model (to `workdir`, whatever save_dir says), and takes metrics.jsonl over when the
  // process that wrote it is lost.
  bool elastic = false;
  // Under --elastic: throws, naming the process, when one of the current generation is lost.
  // Called while the ranks wait for the writer outside any collective, which would otherwise not
  // notice a lost writer.
  std::function<void()> peers_alive;
  // Under --elastic: whether an error of a checkpoint's collectives or waits means a process was
  // lost. That checkpoint is then abandoned (the previous one stays whole) and training goes on:
  // the next step recovers.
  std::function<bool(const std::exception&)> lost_peer;
  // Under --elastic: whether this process keeps metrics.jsonl after a membership change (it takes
  // the file over when the process that kept it was lost).
  std::function<bool()> keeps_metrics;
  // Under --elastic, a replacement that joined the run under way (its state received from the
  // others): where it starts, instead of a checkpoint. It chooses no checkpoint and keeps no
  // metrics.jsonl (the others' rank 0 does).
  struct JoinedAt {
    int64_t epoch = 0;
    int64_t batch_in_epoch = 0;  // the epoch's batches the others had trained
    int64_t global_step = 0;     // the steps they had taken
  };
  std::optional<JoinedAt> joined_at;
};

struct TrainingData {
  // The training loader of an epoch (called once at the start of each epoch, on every rank).
  std::function<data::BatchLoader&(int64_t epoch)> train;
  data::BatchLoader* validation = nullptr;
  const std::vector<data::TranslationExample>* test = nullptr;
  const data::Tokenizer* tokenizer = nullptr;
  // Optional: told where each epoch starts (its first batch: 0, or a resumed position), before
  // its first step (elastic training keeps other replicas' loaders there).
  std::function<void(int64_t epoch, int64_t first_batch)> epoch_started;
  // Optional: the membership changes since the last call (elastic training), asked after every
  // step and logged to metrics.jsonl.
  std::function<std::vector<MembershipRecord>()> membership_changes;
};

struct TrainingSummary {
  std::vector<double> epoch_seconds, epoch_token_rates;  // every epoch, resumed ones included
  int64_t global_step = 0;
  int64_t training_steps = 0;  // the run's optimizer steps, over which the schedule runs
  std::string resumed_from;  // the checkpoint resumed, or empty
};

// Trains options.n_epochs epochs, or options.controls.max_steps optimizer steps where fewer
// (resuming first when options.checkpoint.resume says so), printing and writing SPEC §7's lines
// and files, checkpointing, and logging every step to <workdir>/metrics.jsonl (the process that
// reports data-parallel rank 0's lines writes it). The learning rate of each step follows
// options.controls.lr_schedule over the run's steps, continued where a resumed run stopped. `world` (null for one
// process) is the group whose ranks all call this together: the choice of checkpoint is agreed
// over it and checkpoints gather every rank's generator states over it; rank 0 writes them.
TrainingSummary run_training(TrainStep& step, const TrainingData& data, const TrainingOptions& options,
                             const data_parallel::DistContext* world = nullptr);

// --pytest: one step on the first batch (the first `accumulation_steps` batches, accumulated),
// after which each rank writes its averaged (unsplit) gradients to `path` as a torch.load-able
// dict, before the optimizer step.
void write_gradients_of_one_step(TrainStep& step, data::BatchLoader& loader, const std::string& path,
                                 int64_t accumulation_steps = 1);

// Validation loss, generations and BLEU of the step's model (SPEC §3), as the step evaluates it
// (TrainStep::validation_loss and generate: a collective where the model is split).
struct EpochEvaluation {
  double validation_loss = 0.0;
  double bleu = 0.0;
  std::vector<std::string> generations;
};
EpochEvaluation evaluate_epoch(TrainStep& step, data::BatchLoader& validation, const data::Tokenizer& tokenizer,
                               const std::vector<data::TranslationExample>& test, int64_t model_max_length,
                               bool progress);

}  // namespace harness::train
