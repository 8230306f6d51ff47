// run_data_parallel: GPT-2 translation training with data parallelism over a c10d process group
// (Gloo on CPUs, NCCL on GPUs). Started plainly it launches --world_size workers of itself;
// started by torchrun or Slurm (RANK/WORLD_SIZE/... set) it is one of those workers. SPEC §5, §7.
// --tensor_parallel_size T > 1 splits each model replica over T ranks (Megatron style): the world
// is data-parallel size x T ranks, the data is partitioned over the data-parallel ranks only.
// --context_parallel_size C > 1 splits each sequence of a replica's batch over C ranks (ring
// attention on zigzag chunks). --sequence_parallel with T > 1 splits the sequence over the
// tensor-parallel ranks between their split layers too (Megatron's sequence parallelism).
#include <cstdlib>
#include <iostream>
#include <optional>

#include "common.h"
#include "pipeline_flags.h"
#include "harness/host_memory.h"
#include "harness/pipeline/activation_meter.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/partition.h"
#include "harness/data_parallel/process_group.h"
#include "harness/train/plan/memory_plan.h"

namespace harness::apps {
namespace {

namespace dp = harness::data_parallel;

struct DataParallelFlags {
  train::DataParallelConfig config;
  std::string export_dataset;
};

// run_data_parallel's own flags, beside the common ones and the pipeline's.
void add_data_parallel_options(cxxopts::Options& options) {
  options.add_options()
      ("world_size", "processes in all: data x context x tensor x pipeline", cxxopts::value<int>()->default_value("2"), "N")
      ("tensor_parallel_size", "ranks that split each layer of a replica", cxxopts::value<int>()->default_value("1"), "T")
      ("pipeline_parallel_size", "pipeline stages, each its own processes", cxxopts::value<int>()->default_value("1"), "P")
      ("context_parallel_size", "ranks that split each sequence (ring attention)", cxxopts::value<int>()->default_value("1"), "C")
      ("sequence_parallel", "with T > 1: LayerNorm and dropout on 1/T of each sequence")
      ("backend", "auto | gloo | nccl; auto: nccl on GPUs, gloo on CPUs", cxxopts::value<std::string>()->default_value("auto"), "NAME")
      ("device", "auto | cpu | cuda; auto: GPU local_rank if there is one", cxxopts::value<std::string>()->default_value("auto"), "KIND")
      ("master_addr", "rendezvous host (default: $MASTER_ADDR, else localhost)", cxxopts::value<std::string>()->default_value(""), "HOST")
      ("master_port", "rendezvous port (default: $MASTER_PORT, else 11868)", cxxopts::value<int>()->default_value("0"), "PORT")
      ("dist_timeout_s", "seconds the rendezvous and each collective may take", cxxopts::value<int>()->default_value("300"), "S")
      ("grad_sync", "bucketed (overlapped with backward) | naive (per parameter, after)", cxxopts::value<std::string>()->default_value("bucketed"), "KIND")
      ("bucket_cap_mb", "bucket size of --grad_sync bucketed", cxxopts::value<double>()->default_value("25"), "MB")
      ("allreduce", "builtin (the process group's) | ring (on send/recv)", cxxopts::value<std::string>()->default_value("builtin"), "KIND")
      ("grad_reduce_dtype", "fp32 | bf16: the dtype gradients are reduced in", cxxopts::value<std::string>()->default_value("fp32"), "DTYPE")
      ("zero_stage", "0 | 1 | 2 | 3: shard optimizer state, then gradients, then parameters", cxxopts::value<int>()->default_value("0"), "S")
      ("zero_prefetch", "units all-gathered ahead under --zero_stage 3", cxxopts::value<int>()->default_value("1"), "N")
      ("memory_plan", "print each rank's memory plan for this layout and exit")
      ("pytest", "train one batch, write each rank's gradients to --grad_dir", cxxopts::value<bool>()->default_value("false")->implicit_value("true"), "True|False")
      ("grad_dir", "folder of the --pytest gradient files", cxxopts::value<std::string>()->default_value("tests"), "DIR")
      ("reshuffle_each_epoch", "a new seeded partition of the training set every epoch")
      ("save_every_rank", "ranks above 0 also write their replica to <workdir>/rank{r}/")
      ("max_restarts", "restart the group after a worker dies, up to N times", cxxopts::value<int>()->default_value("0"), "N")
      ("debug_sync", "compare each collective's fingerprint across ranks before it runs")
      ("synchronous_step", "zb1p/zbv stage processes: step after the global norm, no early step to undo")
      ("elastic", "a lost data-parallel replica does not end the run: the others continue")
      ("min_replicas", "with --elastic: the fewest replicas to continue with", cxxopts::value<int>()->default_value("1"), "N");
}

// The plan: the layout's sizes, ZeRO, the gradient sync, the pipeline's schedule, --elastic.
train::Plan read_plan(const cxxopts::ParseResult& result) {
  train::Plan plan;
  plan.world_size = result["world_size"].as<int>();
  plan.gradient_sync.allreduce = dp::parse_allreduce_algorithm(result["allreduce"].as<std::string>());
  plan.gradient_sync.kind = dp::parse_gradient_sync(result["grad_sync"].as<std::string>());
  plan.gradient_sync.bucket_cap_mb = result["bucket_cap_mb"].as<double>();
  plan.tensor_parallel_size = result["tensor_parallel_size"].as<int>();
  plan.elastic = result.count("elastic") > 0;
  plan.min_replicas = result["min_replicas"].as<int>();
  if (result.count("min_replicas") > 0 && !plan.elastic) {
    throw std::invalid_argument("--min_replicas applies to --elastic runs only");
  }
  const std::string reduce_dtype = result["grad_reduce_dtype"].as<std::string>();
  if (reduce_dtype != "fp32" && reduce_dtype != "bf16") {
    throw std::invalid_argument("--grad_reduce_dtype '" + reduce_dtype + "': expected fp32 or bf16");
  }
  plan.gradient_sync.reduce_dtype = reduce_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  plan.zero.stage = result["zero_stage"].as<int>();
  plan.zero.prefetch = result["zero_prefetch"].as<int>();
  plan.pipeline_parallel_size = result["pipeline_parallel_size"].as<int>();
  plan.context_parallel_size = result["context_parallel_size"].as<int>();
  plan.sequence_parallel = result.count("sequence_parallel") > 0;
  plan.pipeline = read_pipeline_flags(result);
  if (plan.world_size <= 0) {
    throw std::invalid_argument("--world_size must be positive, got " + std::to_string(plan.world_size));
  }
  if (plan.tensor_parallel_size < 1) {
    throw std::invalid_argument("--tensor_parallel_size must be at least 1, got " +
                                std::to_string(plan.tensor_parallel_size));
  }
  return plan;
}

// How the processes start, meet and fail: the launcher's, the rendezvous' and --pytest's flags.
void read_launch(const cxxopts::ParseResult& result, train::DataParallelConfig& c) {
  c.pytest = result["pytest"].as<bool>();
  c.save_every_rank = result.count("save_every_rank") > 0;
  c.reshuffle_each_epoch = result.count("reshuffle_each_epoch") > 0;
  c.grad_dir = result["grad_dir"].as<std::string>();
  c.backend = dp::parse_backend(result["backend"].as<std::string>());
  c.device = harness::parse_device_choice(result["device"].as<std::string>());
  c.master_addr = result["master_addr"].as<std::string>();
  c.master_port = result["master_port"].as<int>();
  c.max_restarts = result["max_restarts"].as<int>();
  c.dist_timeout_s = result["dist_timeout_s"].as<int>();
  c.debug_sync = result.count("debug_sync") > 0;
  c.synchronous_step = result.count("synchronous_step") > 0;
  if (c.dist_timeout_s < 1) {
    throw std::invalid_argument("--dist_timeout_s must be at least 1, got " + std::to_string(c.dist_timeout_s));
  }
  if (c.max_restarts < 0) {
    throw std::invalid_argument("--max_restarts must be >= 0, got " + std::to_string(c.max_restarts));
  }
  if (c.master_port < 0 || c.master_port > 65535) {
    throw std::invalid_argument("--master_port " + std::to_string(c.master_port) + " is not a port");
  }
}

DataParallelFlags parse(int argc, char** argv) {
  const std::string what =
      "Train GPT-2 (German->English) with data, context, tensor and pipeline parallelism over processes.";
  cxxopts::Options options("run_data_parallel", what);
  add_common_options(options, /*default_batch_size=*/128, /*default_epochs=*/10);
  add_data_parallel_options(options);
  add_pipeline_options(options, "with --pipeline_parallel_size above 1");
  cxxopts::ParseResult result = parse_or_exit(options, what, argc, argv);
  DataParallelFlags flags;
  try {
    const CommonFlags common = read_common(result);
    flags.export_dataset = common.export_dataset;
    flags.config.run = common;
    flags.config.run.memory_plan = result.count("memory_plan") > 0;
    read_launch(result, flags.config);
    flags.config.plan = read_plan(result);
  } catch (const std::exception& e) {
    std::cerr << "run_data_parallel: " << e.what() << std::endl;
    std::exit(2);
  }
  return flags;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::string(value) : fallback;
}

}  // namespace
}  // namespace harness::apps

int main(int argc, char** argv) {
  harness::keep_freed_host_memory();  // reuse, not re-fault, the large tensors of each step
  using namespace harness::apps;
  // Counts every CPU tensor allocation; each rank reports its peak after training (docs/performance.md).
  if (env_or("HARNESS_COUNT_CPU_TENSORS", "0") == "1") harness::pipeline::install_activation_meter();
  const DataParallelFlags flags = parse(argc, argv);
  const harness::train::DataParallelConfig& config = flags.config;
  try {
    if (!flags.export_dataset.empty()) {
      const harness::train::RunConfig& run = config.run;
      harness::data::export_jsonl(harness::train::load_corpus(run.dataset, run.sizes, run.seed, run.sizes_given),
                                  flags.export_dataset);
      std::cout << "wrote the corpus to " << flags.export_dataset << std::endl;
      return 0;
    }
    std::optional<dp::WorkerEnv> env = dp::worker_env_from_environment();
    if (config.run.memory_plan) return env && env->rank != 0 ? 0 : harness::train::print_memory_plan(config);
    if (env) return harness::train::run_data_parallel_worker(config, *env);
    // Not started by a launcher: start --world_size workers of this program here.
    const std::string addr = !config.master_addr.empty() ? config.master_addr : env_or("MASTER_ADDR", "localhost");
    const int port = config.master_port > 0 ? config.master_port
                                            : std::atoi(env_or("MASTER_PORT", std::to_string(dp::kDefaultMasterPort)).c_str());
    // Whatever would fail in every worker fails here, once, before any process starts.
    harness::train::check_data_parallel_run(config);
    std::vector<std::string> args(argv, argv + argc);
    dp::LaunchOptions launch;
    // A rank stopped (SIGSTOP) past the collective timeout is named as the cause and ends the run;
    // the others fail on their own by then.
    launch.unresponsive_worker_timeout = std::chrono::seconds(config.dist_timeout_s + 10);
    // With restarts the launcher serves the rendezvous store, as torchrun's agent does: one store
    // for every attempt, which no worker's death takes with it.
    launch.serve_store = config.max_restarts > 0 || config.plan.elastic;
    // --elastic: a lost worker is recorded in the store and the others go on (elastic_step.h).
    launch.elastic = config.plan.elastic;
    if (config.plan.elastic) {
      launch.extra_env.emplace_back(harness::train::kElasticLaunchVariable, "1");
      // A replacement starts for each lost worker and joins at a step boundary (elastic_trainer.h).
      const std::string replacements = env_or(harness::train::kElasticReplacementsVariable, "");
      if (replacements.find_first_not_of("0123456789") != std::string::npos || replacements.size() > 6) {
        throw std::invalid_argument(std::string(harness::train::kElasticReplacementsVariable) + "=" + replacements +
                                    ": expected a count of replacement processes (0 or more)");
      }
      launch.max_replacements = replacements.empty() ? config.plan.world_size : std::atoi(replacements.c_str());
    }
    return dp::launch_with_restarts(args, config.plan.world_size, addr, port, config.max_restarts, launch);
  } catch (const std::exception& e) {
    std::cerr << "run_data_parallel: error: " << e.what() << std::endl;
    return 1;
  }
}
