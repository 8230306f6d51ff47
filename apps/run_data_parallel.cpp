// run_data_parallel: GPT-2 translation training with data parallelism over a c10d process group
// (Gloo on CPUs, NCCL on GPUs). Started plainly it launches --world_size workers of itself;
// started by torchrun or Slurm (RANK/WORLD_SIZE/... set) it is one of those workers. SPEC §5, §7.
// --tensor_parallel_size T > 1 splits each model replica over T ranks (Megatron style): the world
// is data-parallel size x T ranks, the data is partitioned over the data-parallel ranks only.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <chrono>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "common.h"
#include "harness/data_parallel/checkpoint_io.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/partition.h"
#include "harness/data_parallel/process_group.h"
#include "harness/data_parallel/ring_all_reduce.h"
#include "harness/data_parallel/sharded_loader.h"
#include "harness/model/safetensors.h"
#include "harness/tensor_parallel/gpt2_tensor_parallel.h"
#include "harness/tensor_parallel/parallel_context.h"
#include "harness/trace.h"
#include "harness/train/loss.h"

namespace harness::apps {
namespace {

namespace dp = harness::data_parallel;
namespace tp = harness::tensor_parallel;
namespace fs = std::filesystem;

struct DataParallelFlags {
  CommonFlags common;
  int world_size = 2;
  bool pytest = false;
  bool save_every_rank = false;
  dp::AllReduceAlgorithm allreduce = dp::AllReduceAlgorithm::kBuiltin;
  bool reshuffle_each_epoch = false;
  std::string grad_dir = "tests";
  std::string backend = "auto";
  std::string device = "auto";
  std::string master_addr;
  int master_port = 0;
  std::string grad_sync = "bucketed";
  double bucket_cap_mb = 25.0;
  int tensor_parallel_size = 1;
  int max_restarts = 0;
};

DataParallelFlags parse(int argc, char** argv) {
  cxxopts::Options options("run_data_parallel",
                           "Train GPT-2 (German->English) with data parallelism over a process group");
  add_common_options(options, /*default_batch_size=*/128, /*default_epochs=*/10);
  options.add_options()
      ("world_size", "number of ranks (worker processes started here)", cxxopts::value<int>()->default_value("2"))
      ("pytest", "train one batch and write each rank's gradients to --grad_dir/model{rank}_gradients.pth")
      ("allreduce", "builtin: the process group's all-reduce; ring: ring all-reduce on point-to-point send/recv (with either --grad_sync)", cxxopts::value<std::string>()->default_value("builtin"))
      ("reshuffle_each_epoch", "a new seeded partition of the training set every epoch (seed + epoch, as DistributedSampler.set_epoch); default: the original's fixed partition")
      ("save_every_rank", "besides rank 0's model in --workdir, rank r > 0 writes its replica to --workdir/rank{r}/ (to check that replicas agree)")
      ("grad_dir", "folder for the --pytest gradient files", cxxopts::value<std::string>()->default_value("tests"))
      ("backend", "auto | gloo | nccl (auto: nccl on GPUs, gloo on CPUs)", cxxopts::value<std::string>()->default_value("auto"))
      ("device", "auto | cpu | cuda: what each rank trains on (auto: GPU local_rank if any)", cxxopts::value<std::string>()->default_value("auto"))
      ("master_addr", "rendezvous host (default: $MASTER_ADDR or localhost)", cxxopts::value<std::string>()->default_value(""))
      ("master_port", "rendezvous port (default: $MASTER_PORT or 11868)", cxxopts::value<int>()->default_value("0"))
      ("grad_sync", "bucketed: overlapped all-reduce of gradient buckets during backward; naive: the original's per-parameter all-reduce after backward", cxxopts::value<std::string>()->default_value("bucketed"))
      ("bucket_cap_mb", "bucket size for --grad_sync bucketed", cxxopts::value<double>()->default_value("25"))
      ("max_restarts", "as torchrun's --max-restarts: when a worker dies, restart the whole group up to N times, resuming from the newest complete checkpoint", cxxopts::value<int>()->default_value("0"))
      ("tensor_parallel_size", "ranks that split one model replica (Megatron-style tensor parallelism); --world_size = data-parallel size x this", cxxopts::value<int>()->default_value("1"));
  cxxopts::ParseResult result = parse_or_exit(options, argc, argv);
  DataParallelFlags flags;
  try {
    flags.common = read_common(result);
    flags.world_size = result["world_size"].as<int>();
    flags.pytest = result.count("pytest") > 0;
    flags.save_every_rank = result.count("save_every_rank") > 0;
    flags.allreduce = dp::parse_allreduce_algorithm(result["allreduce"].as<std::string>());
    flags.reshuffle_each_epoch = result.count("reshuffle_each_epoch") > 0;
    flags.grad_dir = result["grad_dir"].as<std::string>();
    flags.backend = result["backend"].as<std::string>();
    flags.device = result["device"].as<std::string>();
    flags.master_addr = result["master_addr"].as<std::string>();
    flags.master_port = result["master_port"].as<int>();
    flags.grad_sync = result["grad_sync"].as<std::string>();
    flags.bucket_cap_mb = result["bucket_cap_mb"].as<double>();
    flags.tensor_parallel_size = result["tensor_parallel_size"].as<int>();
    flags.max_restarts = result["max_restarts"].as<int>();
    if (flags.max_restarts < 0) {
      throw std::invalid_argument("--max_restarts must be >= 0, got " + std::to_string(flags.max_restarts));
    }
    if (flags.world_size <= 0) {
      throw std::invalid_argument("--world_size must be positive, got " + std::to_string(flags.world_size));
    }
    if (flags.tensor_parallel_size < 1) {
      throw std::invalid_argument("--tensor_parallel_size must be at least 1, got " +
                                  std::to_string(flags.tensor_parallel_size));
    }
    if (flags.device != "auto" && flags.device != "cpu" && flags.device != "cuda") {
      throw std::invalid_argument("--device '" + flags.device + "': expected auto, cpu or cuda");
    }
    if (flags.master_port < 0 || flags.master_port > 65535) {
      throw std::invalid_argument("--master_port " + std::to_string(flags.master_port) + " is not a port");
    }
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

// Rank r's device: GPU local_rank under CUDA, else a CPU lane.
Device worker_device(const DataParallelFlags& flags, int local_rank) {
  const bool gpus = torch::cuda::is_available();
  if (flags.device == "cuda" || (flags.device == "auto" && gpus)) {
    if (!gpus) throw std::invalid_argument("--device cuda but no GPU is present (use --device cpu)");
    const int count = static_cast<int>(torch::cuda::device_count());
    if (local_rank >= count) {
      throw std::invalid_argument("local rank " + std::to_string(local_rank) + " needs GPU " +
                                  std::to_string(local_rank) + " but only " + std::to_string(count) +
                                  " are present: lower --world_size or use --device cpu");
    }
    return Device::cuda(local_rank);
  }
  return Device::cpu(local_rank);
}

// Every rank starts from rank 0's weights, as DDP does.
void broadcast_parameters(const dp::DistContext& ctx, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (torch::Tensor& p : module.parameters()) {
    std::vector<at::Tensor> tensors{p};
    ctx.group->broadcast(tensors)->wait();
  }
}

int run_worker(const DataParallelFlags& flags, const dp::WorkerEnv& env) {
  const CommonFlags& f = flags.common;
  const int rank = env.rank;
  const Device device = worker_device(flags, env.local_rank);
  const int local_world = std::max(1, std::atoi(env_or("LOCAL_WORLD_SIZE", std::to_string(env.world_size)).c_str()));
  const int threads = f.threads_per_device > 0 ? f.threads_per_device : default_threads_per_device(local_world);
  at::set_num_threads(threads);

  const dp::DistOptions options = dp::dist_options_for(env, flags.backend, device);
  // T > 1: this rank holds 1/T of a model replica; its data-parallel group (the ranks holding the
  // same shard) is what the batch is partitioned over and the gradients are averaged over.
  const int T = flags.tensor_parallel_size;
  const tp::ParallelLayout layout = tp::parallel_layout(env.world_size, T, rank);
  const dp::DistContext world = dp::init_process_group(options);
  std::optional<tp::ParallelContext> parallel;
  if (T > 1) parallel = tp::make_parallel_context(world, options, T);
  const dp::DistContext& ctx = parallel ? parallel->data : world;
  const int dp_rank = layout.data_rank, dp_size = layout.data_parallel_size;
  const int64_t device_batch = dp::per_device_batch_size(f.batch_size, dp_size);

  train::make_directories(f.workdir);
  data::TranslationCorpus corpus = train::load_corpus(f.dataset, f.sizes, f.seed);
  model::GPT2Config config = train::resolve_config(f.model);
  // Every rank trains the same tokenizer (deterministic); only rank 0 keeps the file, so the
  // ranks need no shared folder when they span machines.
  const std::string tokenizer_path =
      rank == 0 ? f.workdir + "/tokenizer.model"
                : (fs::temp_directory_path() / ("harness-tokenizer-" + std::to_string(::getpid()) + ".model")).string();
  data::Tokenizer tokenizer = train::prepare_tokenizer(f.model, config, corpus.train, tokenizer_path);
  if (f.fit_vocab) train::fit_vocabulary(config, f.model, tokenizer);

  if (T > 1) tp::validate_tensor_parallel(config, T);
  model::GPT2LMHeadModel model = train::build_model(f.model, config, f.seed);
  model->to(device.torch_device());
  broadcast_parameters(world, *model);
  std::unique_ptr<dp::GradientSynchronizer> sync =
      dp::make_gradient_synchronizer(flags.grad_sync, ctx, flags.bucket_cap_mb, flags.allreduce);
  std::unique_ptr<train::TrainStep> step;
  if (parallel) {
    // The split model trains; the unsplit one is kept for evaluation and saving.
    tp::TensorParallelGPT2LMHeadModel split(config, parallel->tensor);
    split->to(device.torch_device());
    split->load_from(*model);
    step = std::make_unique<train::TensorParallelTrainStep>(split.ptr(), model, f.learning_rate, sync.get());
  } else {
    step = std::make_unique<train::GPT2TrainStep>(model, f.learning_rate, sync.get());
  }
  // Dropout differs per data-parallel rank, as it would in PyTorch's DDP with one seed per
  // process; the ranks of one tensor-parallel group share the seed, so that they draw the same
  // masks on the activations they all hold (Megatron does the same for its replicated regions;
  // attention dropout on each rank's own heads draws from a stream of its own, parallel_rng.h).
  torch::manual_seed(f.seed + static_cast<uint64_t>(dp_rank));

  if (rank == 0) {
    std::cerr << "run_data_parallel: world_size=" << env.world_size << " backend=" << ctx.backend
              << " device=" << device.str() << " threads_per_rank=" << threads << " model="
              << (f.model.path.empty() ? f.model.preset : f.model.path) << " ("
              << model::count_parameters(*model) << " parameters) vocab=" << tokenizer.vocab_size()
              << " batch_size=" << f.batch_size << " (per rank " << device_batch << ")"
              << " grad_sync=" << flags.grad_sync << " allreduce=" << dp::to_string(flags.allreduce)
              << " reshuffle_each_epoch=" << (flags.reshuffle_each_epoch ? "true" : "false");
    if (T > 1) {
      std::cerr << " tensor_parallel_size=" << T << " data_parallel_size=" << dp_size;
    }
    std::cerr << std::endl;
  }

  const int64_t max_length = f.model_max_length;
  data::CollateFn collate = [&tokenizer, max_length](const std::vector<data::TranslationExample>& ex) {
    return data::collate(ex, tokenizer, max_length);
  };
  dp::ShardedLoader train_shards(dp_rank, dp_size, corpus.train, f.batch_size, collate,
                                dp::kDefaultPartitionSeed, flags.reshuffle_each_epoch);
  data::BatchLoader validation_loader(corpus.validation, collate, {device_batch, false, 0, false, 2});
  std::unique_ptr<Tracer> tracer = f.trace.empty() ? nullptr : std::make_unique<Tracer>();
  const std::string track = "rank " + std::to_string(rank);
  step->tracer = tracer.get();
  step->trace_track = track;
  // Rank r > 0 keeps its copy of the tokenizer until the driver has compared it with a checkpoint's.
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() {
      if (!path.empty()) ::unlink(path.c_str());
    }
  } temporary_tokenizer{rank != 0 ? tokenizer_path : std::string()};

  if (flags.pytest) {
    // One batch: forward, backward, averaged gradients, written before any optimizer step.
    const std::string path = flags.grad_dir + "/model" + std::to_string(rank) + "_gradients.pth";
    train::write_gradients_of_one_step(*step, train_shards.set_epoch(0), path);
    std::cout << "Rank " << rank << ": wrote " << path << std::endl;
    dp::barrier(world);
    return 0;
  }

  train::TrainingOptions training =
      training_options(f, "run_data_parallel", train::ReportStyle::kDataParallel);
  training.rank = rank;
  training.world_size = env.world_size;
  training.tensor_parallel_size = T;
  training.data_parallel_size = dp_size;
  training.devices = {device.torch_device()};
  training.show_progress = f.progress && rank == 0;
  training.data_order = "partition of --batch_size over the data-parallel ranks from seed " +
                       std::to_string(dp::kDefaultPartitionSeed) +
                       (flags.reshuffle_each_epoch ? ", redrawn each epoch" : ", the same every epoch");
  training.tokenizer_path = tokenizer_path;
  training.save_dir = rank == 0 ? f.workdir
                     : flags.save_every_rank ? f.workdir + "/rank" + std::to_string(rank)
                                             : std::string();
  training.tracer = tracer.get();
  training.trace_track = track;
  train::TrainingData data;
  data.train = [&train_shards](int64_t epoch) -> data::BatchLoader& { return train_shards.set_epoch(epoch); };
  data.validation = &validation_loader;
  data.test = &corpus.test;
  data.tokenizer = &tokenizer;
  train::run_training(*step, data, training, &world);

  if (tracer) {
    fs::path trace(f.trace);
    const std::string path = env.world_size == 1
        ? f.trace
        : (trace.parent_path() / (trace.stem().string() + ".rank" + std::to_string(rank) + trace.extension().string())).string();
    tracer->write_chrome_json(path);
  }
  if (rank == 0) {
    std::cerr << "run_data_parallel: model, tokenizer and results are in " << f.workdir << std::endl;
  }
  dp::barrier(world);
  return 0;
}

}  // namespace
}  // namespace harness::apps

int main(int argc, char** argv) {
  using namespace harness::apps;
  const DataParallelFlags flags = parse(argc, argv);
  try {
    if (!flags.common.export_dataset.empty()) {
      const harness::data::TranslationCorpus corpus =
          harness::train::load_corpus(flags.common.dataset, flags.common.sizes, flags.common.seed);
      harness::data::export_jsonl(corpus, flags.common.export_dataset);
      std::cout << "wrote the corpus to " << flags.common.export_dataset << std::endl;
      return 0;
    }
    std::optional<dp::WorkerEnv> env = dp::worker_env_from_environment();
    if (env) return run_worker(flags, *env);
    // Not started by a launcher: start --world_size workers of this program here.
    const std::string addr = !flags.master_addr.empty() ? flags.master_addr : env_or("MASTER_ADDR", "localhost");
    const int port = flags.master_port > 0 ? flags.master_port
                                           : std::atoi(env_or("MASTER_PORT", std::to_string(dp::kDefaultMasterPort)).c_str());
    // World size = data-parallel size x tensor-parallel size: checked before anything starts.
    tp::parallel_layout(flags.world_size, flags.tensor_parallel_size, 0);
    std::vector<std::string> args(argv, argv + argc);
    return dp::launch_with_restarts(args, flags.world_size, addr, port, flags.max_restarts);
  } catch (const std::exception& e) {
    std::cerr << "run_data_parallel: error: " << e.what() << std::endl;
    return 1;
  }
}
