// The two programs' work as library calls: a plain config in (the programs fill it from their
// flags), SPEC §7's lines and files out. run_pipeline trains on one device, in model parallel or
// through a pipeline; run_data_parallel_worker is one rank of a data-parallel (and optionally
// tensor-parallel) group, started by the program's launcher, torchrun or Slurm.
#pragma once

#include <cstdint>
#include <string>

#include "harness/data/dataset.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/ring_all_reduce.h"
#include "harness/model/precision.h"
#include "harness/train/driver.h"
#include "harness/train/pipeline_forward_backward.h"
#include "harness/train/setup.h"

namespace harness::train {

// What both programs take (SPEC §7).
struct RunConfig {
  int64_t batch_size = 0;
  int64_t n_epochs = 0;
  double learning_rate = 1e-4;
  int64_t model_max_length = 128;
  std::string dataset;
  bool benchmark_only = false;
  int64_t max_batches = 0;
  int64_t gradient_accumulation_steps = 1;  // batches per optimizer step
  model::Precision precision = model::Precision::kFp32;  // --precision (model/precision.h)
  ModelSource model;
  std::string workdir = "./workdir";
  uint64_t seed = 1234;
  std::string devices;         // empty: the program's default
  int threads_per_device = 0;  // 0: cores / devices
  std::string trace;
  data::SplitSizes sizes;
  // Which of --train_size / --validation_size / --test_size were given: a --dataset split with
  // fewer pairs than a size given is an error; than a default size, all of it is used (said once).
  bool sizes_given[3] = {false, false, false};
  bool progress = true;
  bool fit_vocab = false;
  CheckpointOptions checkpoint;
  double weight_decay = 0.01;  // --weight_decay (AdamW's)
  double max_grad_norm = 0.0;  // --max_grad_norm: clip by the global gradient norm; 0: off
  TrainingControls controls;   // --lr_schedule, --warmup_steps, --min_learning_rate, --max_steps, --eval_every
  bool memory_plan = false;    // --memory_plan: print the per-rank memory plan (train/memory_plan.h) and exit
  // The optimizer the programs build: AdamW at learning_rate with weight_decay, clipped at max_grad_norm.
  OptimizerSettings optimizer_settings() const {
    OptimizerSettings settings(learning_rate);
    settings.weight_decay = weight_decay;
    settings.max_grad_norm = max_grad_norm;
    return settings;
  }
};

// The driver's options that come from a RunConfig; each program adds its layout.
TrainingOptions training_options(const RunConfig& config, const std::string& program, ReportStyle style);

// --model_parallel_mode: none (one device), model_parallel (the stages one batch at a time) or
// pipeline_parallel (micro-batches through the stages' schedule).
enum class ModelParallelMode { kSingleDevice, kModelParallel, kPipelineParallel };

// "" / "model_parallel" / "pipeline_parallel"; anything else throws std::invalid_argument naming
// --model_parallel_mode.
ModelParallelMode parse_model_parallel_mode(const std::string& text);
// "single_device" / "model_parallel" / "pipeline_parallel", as the start line prints it.
std::string to_string(ModelParallelMode mode);

struct PipelineConfig {
  RunConfig run;
  ModelParallelMode mode = ModelParallelMode::kSingleDevice;
  bool shuffle = false;  // the original trains in order (shuffle=False)
  PipelineScheduleConfig pipe;  // --n_chunk, --pipeline_schedule, ... (pipeline_parallel)
};
int run_pipeline(const PipelineConfig& config);

struct DataParallelConfig {
  RunConfig run;
  int world_size = 2;
  bool pytest = false;
  bool save_every_rank = false;
  data_parallel::AllReduceAlgorithm allreduce = data_parallel::AllReduceAlgorithm::kBuiltin;
  bool reshuffle_each_epoch = false;
  std::string grad_dir = "tests";
  data_parallel::Backend backend = data_parallel::Backend::kAuto;
  DeviceChoice device = DeviceChoice::kAuto;
  std::string master_addr;
  int master_port = 0;
  data_parallel::GradientSyncKind grad_sync = data_parallel::GradientSyncKind::kBucketed;
  double bucket_cap_mb = 25.0;
  int tensor_parallel_size = 1;
  int context_parallel_size = 1;  // C: ranks that split each sequence (ring attention)
  bool sequence_parallel = false;  // T > 1: LayerNorm and dropout regions split along the sequence too
  int max_restarts = 0;
  int dist_timeout_s = 300;  // rendezvous and collectives
  bool debug_sync = false;   // compare collective fingerprints across ranks (debug_sync.h)
  // --synchronous_step: no optimizer post-validation (every stage waits for the global norm)
  bool synchronous_step = false;
  // --elastic: a lost data-parallel replica does not end the run (train/elastic_step.h); the
  // others continue down to --min_replicas.
  bool elastic = false;
  int min_replicas = 1;
  at::ScalarType grad_reduce_dtype = at::kFloat;  // --grad_reduce_dtype: the gradient all-reduce's, fp32 | bf16
  int zero_stage = 0;                      // 1: AdamW state sharded over the data-parallel ranks
  int zero_prefetch = 1;                   // --zero_stage 3: units all-gathered ahead
  int pipeline_parallel_size = 1;          // P: pipeline stages as processes (SPEC §7.2)
  PipelineScheduleConfig pipe;             // how the stages run when P > 1
};
int run_data_parallel_worker(const DataParallelConfig& config, const data_parallel::WorkerEnv& env);

// Set in the workers run_data_parallel's own launcher starts for --elastic: it holds the store and
// lets the others go on when one is lost. Under torchrun the workers beat through the agent's
// store instead; a worker of another launcher (srun) refuses --elastic.
inline constexpr const char* kElasticLaunchVariable = "HARNESS_ELASTIC_LAUNCHER";
// How many replacement processes an --elastic launch starts over the run, for lost ones (default:
// --world_size; 0: none, the others go on without).
inline constexpr const char* kElasticReplacementsVariable = "HARNESS_ELASTIC_MAX_REPLACEMENTS";

// --elastic's rules (the flags named): D >= 2 replicas (of any C x T x P ranks), no ZeRO,
// 1 <= --min_replicas <= D, the final model in --workdir alone.
// world_size: the run's (under torchrun, WORLD_SIZE's); 0: config.world_size.
void check_elastic_run(const DataParallelConfig& config, int world_size = 0);

// Every rule a worker would apply to the flags, model, data and devices, applied once in the
// launching process before any worker starts, so that a bad run fails at once with one error
// instead of --world_size of them after the rendezvous: the layout and batch, writable
// --workdir (and --grad_dir under --pytest), the dataset's split sizes, --model_path's
// config.json, weights and tokenizer against each other, --model_max_length against the
// positions, the tensor-parallel split, and the GPUs --device needs on this machine.
void check_data_parallel_run(const DataParallelConfig& config);

// --memory_plan: the plan of the run the flags describe (train/memory_plan.h), printed on stdout,
// before any process group, model or data exists. Returns the exit status, 0.
int print_memory_plan(const DataParallelConfig& config);
int print_memory_plan(const PipelineConfig& config);

}  // namespace harness::train
