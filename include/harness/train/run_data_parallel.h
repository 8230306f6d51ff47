// run_data_parallel's work as library calls: a plain config in (the program fills it from its
// flags), SPEC §7's lines and files out. run_data_parallel_worker is one rank of a data x context
// x tensor x pipeline layout, started by the program's launcher, torchrun or Slurm.
#pragma once

#include <string>

#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/ring_all_reduce.h"
#include "harness/train/plan/plan.h"
#include "harness/train/run_config.h"
#include "harness/train/step/pipeline_forward_backward.h"

namespace harness::train {

// run_data_parallel's plan without flags: two processes, data parallel.
inline Plan data_parallel_defaults() {
  Plan plan;
  plan.world_size = 2;
  return plan;
}

struct DataParallelConfig {
  RunConfig run;
  // The layout and every parallel choice (--world_size, the four sizes, --sequence_parallel, ZeRO,
  // the pipeline's schedule, the gradient sync, --elastic and --min_replicas), validated once.
  Plan plan = data_parallel_defaults();
  bool pytest = false;
  bool save_every_rank = false;
  bool reshuffle_each_epoch = false;
  std::string grad_dir = "tests";
  data_parallel::Backend backend = data_parallel::Backend::kAuto;
  DeviceChoice device = DeviceChoice::kAuto;
  std::string master_addr;
  int master_port = 0;
  int max_restarts = 0;
  int dist_timeout_s = 300;  // rendezvous and collectives
  bool debug_sync = false;   // compare collective fingerprints across ranks (debug_sync.h)
  // --synchronous_step: no optimizer post-validation (every stage waits for the global norm)
  bool synchronous_step = false;
};
int run_data_parallel_worker(const DataParallelConfig& config, const data_parallel::WorkerEnv& env);

// Set in the workers run_data_parallel's own launcher starts for --elastic: it holds the store and
// lets the others go on when one is lost. Under torchrun the workers beat through the agent's
// store instead; a worker of another launcher (srun) refuses --elastic.
inline constexpr const char* kElasticLaunchVariable = "HARNESS_ELASTIC_LAUNCHER";
// How many replacement processes an --elastic launch starts over the run, for lost ones (default:
// --world_size; 0: none, the others go on without).
inline constexpr const char* kElasticReplacementsVariable = "HARNESS_ELASTIC_MAX_REPLACEMENTS";

// The rules of a run's flags beyond its plan's (Plan::validate), the flags named: under --elastic
// the final model in --workdir alone, and no --pytest.
void check_elastic_run(const DataParallelConfig& config);

// Every rule a worker would apply to the flags, model, data and devices, applied once in the
// launching process before any worker starts, so that a bad run fails at once with one error
// instead of --world_size of them after the rendezvous: the layout and batch, writable
// --workdir (and --grad_dir under --pytest), the dataset's split sizes, --model_path's
// config.json, weights and tokenizer against each other, --model_max_length against the
// positions, the tensor-parallel split, and the GPUs --device needs on this machine.
void check_data_parallel_run(const DataParallelConfig& config);

// --memory_plan: the plan of the run the flags describe (train/plan/memory_plan.h), printed on stdout,
// before any process group, model or data exists. Returns the exit status, 0.
int print_memory_plan(const DataParallelConfig& config);

}  // namespace harness::train
