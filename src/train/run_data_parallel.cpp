// run_data_parallel's worker (see programs.h): one rank's process group, data partition, model
// (whole, or its tensor-parallel shard) and gradient synchronisation, trained by the driver.
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/debug_sync.h"
#include "harness/data_parallel/elastic_rendezvous.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/partition.h"
#include "harness/data_parallel/process_group.h"
#include "harness/data_parallel/sharded_loader.h"
#include "harness/train/zero/sharded_adamw.h"
#include "harness/train/zero/sharded_units.h"
#include "harness/model/safetensors.h"
#include "harness/parallel/layout.h"
#include "harness/parallel/process_groups.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/tensor_parallel/group.h"
#include "harness/trace.h"
#include "harness/train/context_parallel_step.h"
#include "harness/train/memory_plan.h"
#include "harness/train/pipeline_forward_backward.h"
#include "harness/train/programs.h"
#include "harness/train/rank_agreement.h"
#include "harness/train/compose_step.h"
#include "harness/train/elastic_step.h"
#include "harness/train/zero/zero3_step.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;
namespace tp = harness::tensor_parallel;
namespace fs = std::filesystem;

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::string(value) : fallback;
}

// Rank r's device: GPU local_rank under CUDA, else a CPU lane.
Device worker_device(const DataParallelConfig& flags, int local_rank) {
  if (uses_gpus(flags.device)) {
    if (!torch::cuda::is_available()) throw std::invalid_argument("--device cuda but no GPU is present (use --device cpu)");
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

// Under --debug_sync, rank 0 says how many collectives of the world group were compared.
void report_debug_sync(const dp::DistContext& world) {
  const auto* checked = dynamic_cast<const dp::DebugSyncBackend*>(world.group.get());
  if (checked == nullptr || world.rank != 0) return;
  std::cerr << "--debug_sync: " << checked->checked()
            << " collectives of the world group matched on every rank" << std::endl;
}

// Every rank starts from rank 0's weights, as DDP does.
void broadcast_parameters(const dp::DistContext& ctx, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (torch::Tensor& p : module.parameters()) {
    std::vector<at::Tensor> tensors{p};
    ctx.group->broadcast(tensors)->wait();
  }
}

// The run's data x context x tensor x pipeline layout, validated (sizes and ZeRO stage; the flags
// named). Context parallelism does not run through pipeline stages: refused here, before launch.
parallel::LayoutSizes run_layout_sizes(const DataParallelConfig& flags) {
  parallel::LayoutSizes sizes;
  sizes.tensor = flags.tensor_parallel_size;
  sizes.context = flags.context_parallel_size;
  sizes.pipeline = flags.pipeline_parallel_size;
  sizes.zero_stage = flags.zero_stage;
  sizes.sequence_parallel = flags.sequence_parallel;
  sizes.loss_on_first_stage = pipeline::placement_of(flags.pipe.schedule) == pipeline::StagePlacement::kV;
  return sizes;
}

parallel::Layout run_layout(const DataParallelConfig& flags, int world_size) {
  return parallel::Layout::create(world_size, run_layout_sizes(flags));
}

// The positions each sequence is padded to: --model_max_length, or with C > 1 a multiple of 2C
// (of 2C * T, or of T when C = 1, with --sequence_parallel), which must still fit the model's
// position table.
int64_t padded_sequence_length(const DataParallelConfig& flags, const model::GPT2Config& config) {
  const int C = flags.context_parallel_size;
  const int T = flags.sequence_parallel ? flags.tensor_parallel_size : 1;
  if (C <= 1 && T <= 1) return flags.run.model_max_length;
  const int64_t padded = split_sequence_length(flags.run.model_max_length, C, T);
  if (padded > config.n_positions) {
    const int64_t unit = split_sequence_length(1, C, T);
    const std::string flags_text = std::string(C > 1 ? "--context_parallel_size " + std::to_string(C) : "") +
                                   (C > 1 && T > 1 ? " with " : "") +
                                   (T > 1 ? "--sequence_parallel over --tensor_parallel_size " + std::to_string(T) : "");
    throw std::invalid_argument(flags_text + " pads --model_max_length " + std::to_string(flags.run.model_max_length) +
                                " to " + std::to_string(padded) + " positions (a multiple of " + std::to_string(unit) +
                                "), more than the model's n_positions " + std::to_string(config.n_positions) +
                                ": lower --model_max_length to a multiple of " + std::to_string(unit));
  }
  return padded;
}

// The memory plan's input for this run (memory_plan.h): the layout's sizes, a replica's
// `replica_rows`, the `sequence_length` positions a sequence is padded to (1/C of them a rank),
// the precision, the ZeRO settings and, with P > 1, the stages' options.
MemoryPlanInput plan_input(const DataParallelConfig& flags, const parallel::Layout& layout,
                           const model::GPT2Config& config, int64_t replica_rows, int64_t sequence_length) {
  const RunConfig& f = flags.run;
  const int C = layout.context_parallel_size(), P = layout.pipeline_parallel_size();
  MemoryPlanInput in;
  in.program = "run_data_parallel";
  in.model_name = f.model.path.empty() ? f.model.preset : f.model.path;
  in.config = config;
  in.tensor_parallel_size = layout.tensor_parallel_size();
  // With C > 1 the D x C ranks of a slice share its state (ZeRO shards over them), while each
  // replica's rows are split along the sequence: S / C positions a rank.
  in.data_parallel_size = layout.gradient_group_size();
  in.context_parallel_size = C;
  in.rows_per_replica = replica_rows;
  in.sequence_parallel = flags.sequence_parallel;
  in.tokens = sequence_length / C;
  in.bf16 = f.precision == model::Precision::kBf16;
  in.zero_stage = flags.zero_stage;
  in.zero_prefetch = flags.zero_prefetch;
  in.bucket_cap_mb = flags.bucket_cap_mb;
  if (P > 1) {
    plan_stages(in, P, balanced_pipeline_options(flags.pipe, P, /*processes=*/true, config, replica_rows, sequence_length),
                flags.pipe.balance.automatic);
  }
  return in;
}

// The stages' options from the pipeline flags (checked, the flags named), for P > 1 and a replica
// batch of `replica_batch` rows; the balance numbers are checked against the model's blocks here too.
PipelineStepOptions stage_options(const DataParallelConfig& flags, const parallel::Layout& layout,
                                  const model::GPT2Config& config, int64_t replica_batch) {
  const int P = layout.pipeline_parallel_size();
  const PipelineScheduleConfig& pipe = flags.pipe;
  if (pipe.n_chunk < 1 || pipe.n_chunk > replica_batch) {
    throw std::invalid_argument("--n_chunk " + std::to_string(pipe.n_chunk) + " must be between 1 and the " +
                                std::to_string(replica_batch) + " rows each data-parallel replica trains on");
  }
  PipelineStepOptions options = balanced_pipeline_options(pipe, P, /*processes=*/true, config, replica_batch,
                                                          flags.run.model_max_length);
  // "auto" is timed on the model later; the timed balance goes through the same check there.
  if (!pipe.balance.automatic) {
    (void)pipeline::stage_halves(stage_split_flags(options), static_cast<int>(config.n_layer), P,
                                 stages_from(P, options.virtual_stages, /*processes=*/true));
  }
  return options;
}

}  // namespace

void check_zero_stage(const DataParallelConfig& flags) {
  if (flags.zero_prefetch < 0) {
    throw std::invalid_argument("--zero_prefetch " + std::to_string(flags.zero_prefetch) + " must be >= 0");
  }
  if (flags.zero_stage == 0) return;
  if (flags.grad_sync != dp::GradientSyncKind::kBucketed) {
    throw std::invalid_argument("--zero_stage " + std::to_string(flags.zero_stage) +
                                " reduce-scatters gradient buckets: it needs --grad_sync bucketed, not " +
                                dp::to_string(flags.grad_sync));
  }
  if (flags.allreduce != dp::AllReduceAlgorithm::kBuiltin) {
    throw std::invalid_argument("--zero_stage " + std::to_string(flags.zero_stage) +
                                " reduce-scatters with the process group's collectives: it cannot take --allreduce ring");
  }
}

void check_elastic_run(const DataParallelConfig& flags, int world_size) {
  if (!flags.elastic) return;
  const parallel::Layout layout = run_layout(flags, world_size > 0 ? world_size : flags.world_size);
  const int D = layout.data_parallel_size();
  if (D < 2) {
    throw std::invalid_argument("--elastic keeps training when a data-parallel replica is lost: it needs at least "
                                "2 replicas, and --world_size " + std::to_string(flags.world_size) + " makes " +
                                std::to_string(D) + " (with one, use --max_restarts)");
  }
  if (flags.zero_stage != 0) {
    throw std::invalid_argument("--elastic with --zero_stage " + std::to_string(flags.zero_stage) +
                                ": a lost rank's shard of the optimizer state" +
                                (flags.zero_stage >= 2 ? std::string(" and of the gradients") : std::string()) +
                                (flags.zero_stage == 3 ? std::string(" and parameters") : std::string()) +
                                " exists nowhere else, so its replica could not be dropped; use --zero_stage 0");
  }
  if (flags.min_replicas < 1 || flags.min_replicas > D) {
    throw std::invalid_argument("--min_replicas " + std::to_string(flags.min_replicas) + ": expected 1 to " +
                                std::to_string(D) + " (the data-parallel replicas)");
  }
  if (flags.save_every_rank) {
    throw std::invalid_argument("--save_every_rank with --elastic: the replicas hold the same weights, and the "
                                "current rank 0 saves them to --workdir");
  }
  if (flags.pytest) throw std::invalid_argument("--pytest with --elastic: --pytest trains one step, nothing to recover");
}

void check_data_parallel_run(const DataParallelConfig& flags) {
  const RunConfig& f = flags.run;
  const parallel::Layout layout = run_layout(flags, flags.world_size);
  check_zero_stage(flags);
  check_elastic_run(flags);
  const int64_t replica_batch = dp::per_device_batch_size(f.batch_size, layout.data_parallel_size());
  dp::resolve_backend(flags.backend, worker_device(flags, flags.world_size - 1));
  check_writable_folder(f.workdir, "--workdir");
  if (flags.pytest) check_writable_folder(flags.grad_dir, "--grad_dir");
  load_corpus(f.dataset, f.sizes, f.seed, f.sizes_given);
  const model::GPT2Config config = resolve_config(f.model);
  shipped_tokenizer(f.model, config);
  check_positions(config, f.model_max_length);
  const int64_t sequence_length = padded_sequence_length(flags, config);
  if (layout.pipeline_parallel_size() > 1) (void)stage_options(flags, layout, config, replica_batch);
  if (flags.tensor_parallel_size > 1) model::validate_tensor_parallel(config, flags.tensor_parallel_size);
  // Each rank's model state against the memory each has on this machine, before any weight is read.
  check_model_state_fits(plan_memory(plan_input(flags, layout, config, replica_batch, sequence_length)),
                         available_memory(data_parallel_devices(flags.device, flags.world_size),
                                          /*release_gpu_context=*/true),
                         [&flags](int stage) -> std::string {
                           DataParallelConfig other = flags;
                           other.zero_stage = stage;
                           try {
                             (void)run_layout(other, other.world_size);
                             check_zero_stage(other);
                           } catch (const std::invalid_argument& e) {
                             return e.what();
                           }
                           return std::string();
                         });
  // config.json against model.safetensors: the weights are read and checked as a worker would.
  if (!f.model.path.empty()) build_model(f.model, config, f.seed);
}

int print_memory_plan(const DataParallelConfig& flags) {
  // The sizes as a run checks them (the flags named); the ZeRO stage is planned even where this
  // build cannot run it yet, and said so below.
  parallel::LayoutSizes sizes;
  sizes.tensor = flags.tensor_parallel_size;
  sizes.context = flags.context_parallel_size;
  sizes.pipeline = flags.pipeline_parallel_size;
  const parallel::Layout layout = parallel::Layout::create(flags.world_size, sizes);
  const RunConfig& f = flags.run;
  const int64_t sequence_length = split_sequence_length(
      f.model_max_length, flags.context_parallel_size, flags.sequence_parallel ? flags.tensor_parallel_size : 1);
  const MemoryPlan plan =
      plan_memory(plan_input(flags, layout, resolve_config(f.model),
                             dp::per_device_batch_size(f.batch_size, layout.data_parallel_size()), sequence_length));
  std::vector<Device> devices = data_parallel_devices(flags.device, flags.world_size);
  if (devices.front().is_cuda() && static_cast<int>(torch::cuda::device_count()) < flags.world_size) {
    devices.resize(std::max<size_t>(1, torch::cuda::device_count()));  // the plan still prints
  }
  std::cout << format_memory_plan(plan, available_memory(devices)) << std::flush;
  try {
    sizes.zero_stage = flags.zero_stage;
    sizes.sequence_parallel = flags.sequence_parallel;
    (void)parallel::Layout::create(flags.world_size, sizes);
  } catch (const std::invalid_argument& e) {
    std::cout << "note: planned as asked, but this build cannot run it: " << e.what() << std::endl;
  }
  return 0;
}

namespace {

// Test hook: the rank named drops its last training pair, as a rank reading another copy of the
// dataset would, so that the ranks' tokenizers and training splits differ.
void apply_training_split_test_hook(int rank, std::vector<data::TranslationExample>& train) {
  const char* hook = std::getenv("HARNESS_TEST_DROP_TRAINING_PAIR_ON_RANK");
  if (hook != nullptr && *hook != '\0' && std::atoi(hook) == rank && !train.empty()) train.pop_back();
}

// A file removed when this goes out of scope (none when the path is empty).
struct TemporaryFile {
  std::string path;
  TemporaryFile() = default;
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  ~TemporaryFile() {
    if (!path.empty()) ::unlink(path.c_str());
  }
};

// What a rank trains on: the corpus, the model's config and the tokenizer, the same on every rank.
struct RankInputs {
  std::string tokenizer_path;
  // Rank r > 0 keeps its copy of the tokenizer until the driver has compared it with a checkpoint's.
  TemporaryFile temporary_tokenizer;
  data::TranslationCorpus corpus;
  model::GPT2Config config;
  std::optional<data::Tokenizer> tokenizer;
  int64_t rows = 0;             // of the global batch, on this rank's replica
  int64_t sequence_length = 0;  // positions a sequence is padded to (padded_sequence_length)
};

// Every rank trains its own tokenizer; only rank 0 keeps the file, so the ranks need no shared
// folder when they span machines. They must have trained the same one: checked here. What one
// rank may find wrong on its own machine (its folder, its copy of the dataset) stops every rank
// with the same reason. A replacement joining under --elastic (`joining`) has no group yet: it
// prepares alone, keeps no file, and its errors are its own.
void prepare_rank_inputs(const DataParallelConfig& flags, int rank, const dp::DistContext& world, bool joining,
                         RankInputs& in) {
  const RunConfig& f = flags.run;
  const bool keeps_file = rank == 0 && !joining;
  in.tokenizer_path =
      keeps_file ? f.workdir + "/tokenizer.model"
                 : (fs::temp_directory_path() / ("harness-tokenizer-" + std::to_string(::getpid()) + ".model")).string();
  if (!keeps_file) in.temporary_tokenizer.path = in.tokenizer_path;
  std::string refusal;
  try {
    if (!joining) check_writable_folder(f.workdir, "--workdir");
    in.corpus = load_corpus(f.dataset, f.sizes, f.seed, f.sizes_given);
    if (!joining) apply_training_split_test_hook(rank, in.corpus.train);
    in.config = resolve_config(f.model);
    in.tokenizer.emplace(prepare_tokenizer(f.model, in.config, in.corpus.train, in.tokenizer_path));
    in.sequence_length = padded_sequence_length(flags, in.config);
  } catch (const std::exception& e) {
    if (joining) throw;
    refusal = e.what();
  }
  if (!joining) {
    agree_to_go_on(refusal, &world);
    check_ranks_share_tokenizer(tokenizer_fingerprint(in.corpus.train, in.tokenizer_path), &world);
  }
  if (f.fit_vocab) fit_vocabulary(in.config, f.model, *in.tokenizer);
  if (keeps_file) in.config.save_json_file(f.workdir + "/config.json");  // as the original, at start
}

// Under --elastic, where rank 0 leaves the balance `--balance auto` agreed on (a replacement reads it).
constexpr const char* kAgreedBalanceKey = "elastic/agreed balance";

// P > 1: this rank's stage options. --balance auto: every rank times GPT-2's pieces and rank 0's
// balance is everyone's. Each data-parallel replica draws its own dropout masks, the same on
// every stage of it.
PipelineStepOptions agreed_stage_options(const DataParallelConfig& flags, const parallel::Layout& layout,
                                         const RankInputs& in, model::GPT2LMHeadModel& model, const Device& device,
                                         int rank, const dp::DistContext& world, bool joining) {
  const RunConfig& f = flags.run;
  PipelineStepOptions stage = stage_options(flags, layout, model->config(), in.rows);
  stage.devices = {device};
  stage.seed = f.seed + static_cast<uint64_t>(layout.coordinates_of(rank).data);
  if (!flags.pipe.balance.automatic) return stage;
  if (joining) {
    // The balance the run agreed on at its start, which rank 0 left in the store.
    const std::vector<uint8_t> text = world.store->get(kAgreedBalanceKey);
    std::istringstream halves(std::string(text.begin(), text.end()));
    stage.balance_halves.clear();
    for (int h = 0; halves >> h;) stage.balance_halves.push_back(h);
    return stage;
  }
  const int P = layout.pipeline_parallel_size();
  const int64_t rows = std::max<int64_t>(1, in.rows / stage.micro_batches);
  std::vector<int> halves =
      pipeline::balance_gpt2_by_time(model, device, P * stage.virtual_stages, rows, f.model_max_length);
  at::Tensor agreed =
      torch::tensor(std::vector<int64_t>(halves.begin(), halves.end()), torch::kLong).to(device.torch_device());
  std::vector<at::Tensor> tensors{agreed};
  world.group->broadcast(tensors)->wait();
  agreed = agreed.to(torch::kCPU);
  stage.balance_halves.assign(agreed.data_ptr<int64_t>(), agreed.data_ptr<int64_t>() + agreed.numel());
  if (flags.elastic && rank == 0) {  // for replacements, which time nothing
    std::string text;
    for (const int h : stage.balance_halves) text += std::to_string(h) + " ";
    world.store->set(kAgreedBalanceKey, std::vector<uint8_t>(text.begin(), text.end()));
  }
  return stage;
}

DataParallelSettings data_parallel_settings(const DataParallelConfig& flags) {
  DataParallelSettings s;
  s.zero_stage = flags.zero_stage;
  s.zero_prefetch = flags.zero_prefetch;
  s.gradient_sync = flags.grad_sync;
  s.bucket_cap_mb = flags.bucket_cap_mb;
  s.allreduce = flags.allreduce;
  s.reduce_dtype = flags.grad_reduce_dtype;
  return s;
}

// Rank 0's lines before training: the run, the layout's table and the memory plan.
void print_run(const DataParallelConfig& flags, const parallel::Layout& layout, const dp::WorkerEnv& env,
               const Device& device, int threads, dp::Backend backend, model::GPT2LMHeadModel& model,
               const RankInputs& in, const StepParts& parts) {
  const RunConfig& f = flags.run;
  const int T = layout.tensor_parallel_size(), P = layout.pipeline_parallel_size();
  const int dp_size = layout.data_parallel_size();
  std::cerr << "run_data_parallel: world_size=" << env.world_size << " backend=" << dp::to_string(backend)
            << " device=" << device.str() << " threads_per_rank=" << threads << " model="
            << (f.model.path.empty() ? f.model.preset : f.model.path) << " ("
            << model->unsplit_parameter_count() << " parameters"
            << (T > 1 && P == 1 ? ", " + std::to_string(model::count_parameters(*model)) + " on each rank"
                : P > 1         ? ", " + std::to_string(model::count_parameters(*model)) + " held on rank 0"
                                : std::string())
            << ") vocab=" << in.tokenizer->vocab_size() << " batch_size=" << f.batch_size << " (per rank "
            << in.rows << ")"
            << " grad_sync=" << dp::to_string(flags.grad_sync) << " allreduce=" << dp::to_string(flags.allreduce)
            << " reshuffle_each_epoch=" << (flags.reshuffle_each_epoch ? "true" : "false")
            << " precision=" << model::to_string(f.precision) << " grad_reduce_dtype=" << (flags.grad_reduce_dtype == at::kBFloat16 ? "bf16" : "fp32")
            << " zero_stage=" << flags.zero_stage << (flags.debug_sync ? " debug_sync=true" : "")
            << (f.gradient_accumulation_steps > 1
                    ? " gradient_accumulation_steps=" + std::to_string(f.gradient_accumulation_steps)
                    : "");
  if (flags.elastic) std::cerr << " elastic=true min_replicas=" << flags.min_replicas;
  if (T > 1) std::cerr << " tensor_parallel_size=" << T << " data_parallel_size=" << dp_size;
  if (layout.sequence_parallel()) std::cerr << " sequence_parallel=true";
  if (const int C = layout.context_parallel_size(); C > 1) {
    std::cerr << " context_parallel_size=" << C << (T > 1 ? "" : " data_parallel_size=" + std::to_string(dp_size))
              << " sequence_length=" << in.sequence_length << " (" << in.sequence_length / C << " positions per rank)";
  }
  if (parts.stages) {
    std::cerr << " pipeline_parallel_size=" << P << " data_parallel_size=" << dp_size
              << " pipeline_schedule=" << pipeline::to_string(flags.pipe.schedule) << " n_chunk=" << flags.pipe.n_chunk
              << " virtual_stages=" << pipeline::chunks_per_device(flags.pipe.schedule, flags.pipe.virtual_stages)
              << " stages=" << parts.stages->stages()
              << " balance=" << parts.stages->balance_text()
              << pipeline::balance_origin(flags.pipe.balance, /*pipelined=*/true)
              << " activation_checkpointing=" << pipeline::to_string(flags.pipe.activation_checkpointing);
    if (pipeline::splits_backward(flags.pipe.schedule)) {
      std::cerr << " post_validation=" << (flags.synchronous_step ? "false" : "true");
    }
  }
  std::cerr << std::endl << layout.coordinates_table() << std::flush;
  try {
    const int ranks_here = std::max(1, std::atoi(env_or("LOCAL_WORLD_SIZE", std::to_string(env.world_size)).c_str()));
    const std::vector<Device> here = device.is_cuda() ? std::vector<Device>{device} : std::vector<Device>(ranks_here, device);
    std::cerr << "run_data_parallel: "
              << memory_plan_line(plan_memory(plan_input(flags, layout, model->config(), in.rows, in.sequence_length)),
                                  available_memory(here))
              << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "run_data_parallel: memory plan: not made: " << e.what() << std::endl;
  }
}

// Rank 0's line on what ZeRO keeps there, against what a replicated run keeps on every rank.
void print_zero_state(const DataParallelConfig& flags, int shards, model::GPT2LMHeadModel& model,
                      const StepOptimizer& optimizer) {
  int64_t replicated = 0;
  for (const auto& p : model->parameters()) replicated += 2 * p.numel() * static_cast<int64_t>(p.element_size());
  std::cerr << "run_data_parallel: --zero_stage " << flags.zero_stage << " keeps " << optimizer.state_bytes()
            << " bytes of AdamW state on rank 0 (replicated: " << replicated << " on every rank)"
            << (flags.zero_stage == 2   ? ", and 1/" + std::to_string(shards) + " of the gradients"
                : flags.zero_stage == 3 ? ", and 1/" + std::to_string(shards) + " of the gradients and of the parameters"
                                        : std::string())
            << std::endl;
}

// Rank 0's lines after training: what ZeRO-3 gathered at once and what the synchronizer sent.
void print_after_training(const DataParallelConfig& flags, const dp::GradientSynchronizer* sync) {
  if (const auto* units = dynamic_cast<const zero::ShardedUnits*>(sync); units != nullptr) {
    int64_t largest = 0;
    for (size_t u = 0; u < units->size(); ++u) largest = std::max(largest, units->full_bytes(u));
    std::cerr << "run_data_parallel: --zero_stage 3 held at most " << units->peak_bytes()
              << " bytes of gathered parameters at once while training on rank 0 (largest unit " << largest
              << " bytes, --zero_prefetch " << flags.zero_prefetch << ")" << std::endl;
  }
  if (sync && sync->finalized_steps() > 0) {
    std::cerr << "run_data_parallel: gradient sync put " << sync->communicated_bytes() << " bytes into all-reduces in "
              << sync->finalized_steps() << " optimizer steps ("
              << sync->communicated_bytes() / sync->finalized_steps() << " per step) on rank 0" << std::endl;
  }
}

TrainingOptions rank_training_options(const DataParallelConfig& flags, const parallel::Layout& layout,
                                      const dp::WorkerEnv& env, const Device& device, const RankInputs& in) {
  const RunConfig& f = flags.run;
  const int rank = env.rank;
  TrainingOptions training = training_options(f, "run_data_parallel", ReportStyle::kDataParallel);
  training.rank = rank;
  training.world_size = env.world_size;
  training.tensor_parallel_size = layout.tensor_parallel_size();
  training.data_parallel_size = layout.data_parallel_size();
  // One report per model replica: its tensor rank 0 prints the lines, as its data-parallel rank.
  training.reports = layout.reports(rank);
  training.report_rank = layout.coordinates_of(rank).data;
  training.devices = {device.torch_device()};
  training.show_progress = f.progress && rank == 0;
  training.data_order = "partition of --batch_size over the data-parallel ranks from seed " +
                        std::to_string(dp::kDefaultPartitionSeed) +
                        (flags.reshuffle_each_epoch ? ", redrawn each epoch" : ", the same every epoch");
  training.tokenizer_path = in.tokenizer_path;
  training.save_dir = rank == 0                ? f.workdir
                      : flags.save_every_rank ? f.workdir + "/rank" + std::to_string(rank)
                                              : std::string();
  return training;
}

// Test hook HARNESS_TEST_WEIGHT_DIGESTS=<folder>: after training, each process writes a 64-bit FNV-1a
// digest of its weights' bytes (in the model's parameter order) to <folder>/process<launch rank>.txt,
// so that replicas can be compared bit for bit when one process writes the model.
void record_weight_digest_if_asked(model::GPT2LMHeadModel& model, int launch_rank) {
  const char* folder = std::getenv("HARNESS_TEST_WEIGHT_DIGESTS");
  if (folder == nullptr || *folder == '\0') return;
  uint64_t hash = kFnv1aOffsetBasis;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor w = item.value().detach().to(torch::kCPU).contiguous();
    hash = fnv1a(w.data_ptr(), w.nbytes(), hash);
  }
  std::ofstream(std::string(folder) + "/process" + std::to_string(launch_rank) + ".txt") << hash << '\n';
}

void write_trace(const Tracer& tracer, const std::string& trace, const dp::WorkerEnv& env) {
  const fs::path file(trace);
  const std::string path =
      env.world_size == 1 ? trace
                          : (file.parent_path() / (file.stem().string() + ".rank" + std::to_string(env.rank) +
                                                   file.extension().string()))
                                .string();
  tracer.write_chrome_json(path);
}

// This rank's batches: its share of each training batch, and the validation batches in batches of
// the global --batch_size, as the original's validation loader (with C > 1 each context rank
// evaluates its shard of them; the model sums the loss over the group).
struct RankLoaders {
  RankLoaders(const DataParallelConfig& flags, const parallel::Layout& layout, int rank, const RankInputs& in)
      : flags(flags),
        in(in),
        replicas(layout.data_parallel_size()),
        collate(padded_collate(*in.tokenizer, flags.run.model_max_length)),
        train(shard_of(layout.coordinates_of(rank).data)),
        validation(in.corpus.validation, context_collate(collate, layout, rank),
                   {flags.run.batch_size, false, 0, false, 2}) {}

  // Data-parallel replica `replica`'s share of each training batch: this rank's (train), or under
  // --elastic a dropped replica's, read from the mirror.
  std::unique_ptr<dp::ShardedLoader> shard_of(int replica) const {
    return std::make_unique<dp::ShardedLoader>(replica, replicas, in.corpus.train, flags.run.batch_size, collate,
                                               dp::kDefaultPartitionSeed, flags.reshuffle_each_epoch);
  }

  static data::CollateFn padded_collate(const data::Tokenizer& tokenizer, int64_t max_length) {
    return [&tokenizer, max_length](const std::vector<data::TranslationExample>& ex) {
      return data::collate(ex, tokenizer, max_length);
    };
  }
  static data::CollateFn context_collate(const data::CollateFn& collate, const parallel::Layout& layout, int rank) {
    const int C = layout.context_parallel_size(), cp_rank = layout.coordinates_of(rank).context;
    if (C == 1) return collate;
    return [collate, C, cp_rank](const std::vector<data::TranslationExample>& ex) {
      return context_shard(collate(ex), C, cp_rank);
    };
  }

  const DataParallelConfig& flags;
  const RankInputs& in;
  const int replicas;
  data::CollateFn collate;
  std::unique_ptr<dp::ShardedLoader> train;
  data::BatchLoader validation;
};

// The step a rank trains with: composed once for the layout (`plain`, from `parts`), or under
// --elastic composed again for each generation (elastic_step.h), the dropped replicas' batches
// read from their loaders' mirror.
struct RankStep {
  StepParts parts;  // its forward-backward and optimizer moved into `plain`
  std::unique_ptr<GPT2TrainStep> plain;
  std::unique_ptr<ReplicaBatchMirror> mirror;
  std::unique_ptr<ElasticTrainStep> elastic;

  TrainStep& step() { return elastic ? static_cast<TrainStep&>(*elastic) : *plain; }
};

RankStep compose_rank_step(const DataParallelConfig& flags, const parallel::Layout& layout, int rank,
                           const parallel::ProcessGroups& groups, const dp::DistOptions& options,
                           const dp::DistContext& world, int join_id, const RankLoaders& loaders,
                           model::GPT2LMHeadModel& model, const StepComposition& composition,
                           const TrainStepSettings& settings) {
  const RunConfig& f = flags.run;
  RankStep out;
  if (!flags.elastic) {
    out.parts = compose_step(model, layout, groups, composition);
    out.plain = std::make_unique<GPT2TrainStep>(model, std::move(out.parts.forward_backward),
                                                std::move(out.parts.optimizer), out.parts.sync.get(), settings);
    return out;
  }
  const int dp_rank = layout.coordinates_of(rank).data, dp_size = layout.data_parallel_size();
  const int C = layout.context_parallel_size(), cp_rank = layout.coordinates_of(rank).context;
  out.mirror = std::make_unique<ReplicaBatchMirror>([&loaders](int replica) { return loaders.shard_of(replica); });
  ElasticSettings elastic_settings;
  elastic_settings.min_replicas = flags.min_replicas;
  elastic_settings.sizes = run_layout_sizes(flags);
  // The launcher's replacements (their count: its option) take dropped replicas back whole.
  elastic_settings.accept_joiners = true;
  elastic_settings.join_id = join_id;
  // A survivor blocked in a collective with another survivor learns of the loss when the
  // collective times out, and the launcher declares a stopped process lost a little later.
  elastic_settings.join_window = std::chrono::seconds(flags.dist_timeout_s + 15);
  out.elastic = std::make_unique<ElasticTrainStep>(model, composition, options, world, *out.mirror, elastic_settings,
                                                   settings);
  if (const auto joined = out.elastic->joined_at()) {
    // Its own dropout stream, unlike any other replica's or replacement's (the lost one's
    // cannot be recovered), the same on the tensor ranks of its replica (they join together).
    torch::manual_seed(f.seed + static_cast<uint64_t>((dp_rank + (joined->global_step + 1) * dp_size) * C + cp_rank));
  }
  return out;
}

// Training (or, with --pytest, one step's gradients written), then this rank's lines after it.
void train_rank(const DataParallelConfig& flags, const parallel::Layout& layout, const dp::WorkerEnv& env,
                const Device& device, const RankInputs& in, RankLoaders& loaders, RankStep& rank_step,
                model::GPT2LMHeadModel& model, Tracer* tracer, const std::string& track,
                const dp::DistContext& current_world) {
  const RunConfig& f = flags.run;
  const int rank = env.rank;
  TrainStep& step = rank_step.step();
  if (flags.pytest) {
    // One batch (or --gradient_accumulation_steps of them): forward, backward, averaged
    // gradients, written before any optimizer step.
    const std::string path = flags.grad_dir + "/model" + std::to_string(rank) + "_gradients.pth";
    write_gradients_of_one_step(step, loaders.train->set_epoch(0), path, f.gradient_accumulation_steps);
    std::cout << "Rank " << rank << ": wrote " << path << std::endl;
    return;
  }
  TrainingOptions training = rank_training_options(flags, layout, env, device, in);
  training.tracer = tracer;
  training.trace_track = track;
  TrainingData data;
  data.train = [&loaders](int64_t epoch) -> data::BatchLoader& { return loaders.train->set_epoch(epoch); };
  data.validation = &loaders.validation;
  data.test = &in.corpus.test;
  data.tokenizer = &*in.tokenizer;
  if (ElasticTrainStep* elastic = rank_step.elastic.get()) {
    training.elastic = true;
    training.peers_alive = [elastic] { elastic->trainer().check_members_alive(); };
    training.keeps_metrics = [elastic] { return elastic->trainer().keeps_the_log(); };
    training.lost_peer = [](const std::exception& e) {
      return is_communication_failure(e) || dynamic_cast<const LostProcessError*>(&e) != nullptr;
    };
    ReplicaBatchMirror* mirror = rank_step.mirror.get();
    data.epoch_started = [mirror](int64_t epoch, int64_t first_batch) { mirror->start_epoch(epoch, first_batch); };
    data.membership_changes = [elastic] { return elastic->take_membership_changes(); };
    training.joined_at = elastic->joined_at();
  }
  run_training(step, data, training, &current_world);
  record_weight_digest_if_asked(model, rank_step.elastic ? rank_step.elastic->trainer().launch_rank() : rank);
  if (rank_step.plain) {
    if (rank == 0) print_after_training(flags, rank_step.parts.sync.get());
    if (const StepOptimizer::PostValidation pv = rank_step.plain->optimizer().post_validation(); pv.early > 0) {
      std::cerr << "[rank " << rank << "] optimizer: post-validation stepped " << pv.early
                << " times before the global norm arrived, " << pv.undone << " of them undone (clipped or skipped)"
                << std::endl;
    }
  }
  if (tracer) write_trace(*tracer, f.trace, env);
  if (current_world.rank == 0) {
    std::cerr << "run_data_parallel: model, tokenizer and results are in " << f.workdir << std::endl;
  }
}

// `join_id`: under --elastic, a replacement's launch id (launcher.h's kElasticJoinIdVariable), whose
// `world` is the store alone: it joins the run under way and receives its state; -1 otherwise.
int train_this_rank(const DataParallelConfig& flags, const parallel::Layout& layout, const dp::WorkerEnv& env,
                    const Device& device, int threads, const dp::DistOptions& options, const dp::DistContext& world,
                    int join_id) {
  const RunConfig& f = flags.run;
  const int rank = env.rank;
  const bool joining = join_id >= 0;
  RankInputs in;
  in.rows = dp::per_device_batch_size(f.batch_size, layout.data_parallel_size());
  prepare_rank_inputs(flags, rank, world, joining, in);

  // The model, split over its tensor-parallel group from the start (each rank builds and loads its
  // own slices), starts from rank 0's weights on every rank that holds the same slices (a
  // replacement: from the weights the others send it as it joins).
  const parallel::ProcessGroups groups = joining ? parallel::ProcessGroups{}
                                                 : parallel::make_process_groups(world, options, layout);
  const int T = layout.tensor_parallel_size();
  std::shared_ptr<model::TensorParallelGroup> split =
      T == 1    ? nullptr
      : joining ? tp::make_unconnected_tensor_parallel_group(layout.coordinates_of(rank).tensor, T)
                : tp::make_tensor_parallel_group(groups.tensor);
  model::GPT2LMHeadModel model = build_model(f.model, in.config, f.seed, split);
  model->to(device.torch_device());
  if (!joining) broadcast_parameters(groups.gradient, *model);

  std::unique_ptr<Tracer> tracer = f.trace.empty() ? nullptr : std::make_unique<Tracer>();
  const std::string track = "rank " + std::to_string(rank);
  StepComposition composition;
  composition.optimizer = f.optimizer_settings();
  // (Under --elastic no stage steps before the others are known alive: post-validation is off.)
  composition.optimizer.post_validate = !flags.synchronous_step && !flags.elastic;
  composition.data_parallel = data_parallel_settings(flags);
  composition.debug_sync = flags.debug_sync;
  if (layout.pipeline_parallel_size() > 1) {
    composition.stages = agreed_stage_options(flags, layout, in, model, device, rank, world, joining);
    composition.stages->tracer = tracer.get();  // each stage action a slice on the rank's trace
  }
  TrainStepSettings settings;
  settings.precision = f.precision;
  settings.tracer = tracer.get();
  settings.trace_track = track;
  // Dropout differs per data-parallel rank, as it would in PyTorch's DDP with one seed per
  // process; the ranks of one tensor-parallel group share the seed, so that they draw the same
  // masks on the activations they all hold (Megatron does the same for its replicated regions;
  // attention dropout on each rank's own heads draws from a stream of its own, parallel_rng.h).
  // The ranks of a context group hold different positions: each draws its own masks.
  const int C = layout.context_parallel_size();
  const parallel::Coordinates here = layout.coordinates_of(rank);
  torch::manual_seed(f.seed + static_cast<uint64_t>(here.data * C + here.context));
  RankLoaders loaders(flags, layout, rank, in);

  RankStep rank_step =
      compose_rank_step(flags, layout, rank, groups, options, world, join_id, loaders, model, composition, settings);
  if (rank_step.plain && flags.zero_stage >= 1 && rank == 0) {
    print_zero_state(flags, layout.gradient_group_size(), model, rank_step.plain->optimizer());
  }
  if (rank == 0 && !joining) {
    print_run(flags, layout, env, device, threads, groups.gradient.backend, model, in, rank_step.parts);
  }
  // The world the run's collectives and checkpoints go over: the current generation's under --elastic.
  const dp::DistContext& current_world = rank_step.elastic ? rank_step.elastic->world() : world;
  train_rank(flags, layout, env, device, in, loaders, rank_step, model, tracer.get(), track, current_world);
  dp::barrier(current_world);
  report_debug_sync(current_world);
  return 0;
}

// "host2 10.77.0.3": this rank's hostname, and across hosts the address it reaches MASTER_ADDR
// from, for the messages that name a rank's host.
std::string host_label(const dp::DistOptions& options) {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  std::string label = name;
  if (!dp::is_loopback(options.master_addr)) {
    try {
      label += " " + dp::local_address_toward(options.master_addr, options.master_port);
    } catch (const std::exception&) {
      // The rendezvous got through: only the label goes without its address.
    }
  }
  return label;
}

// How long a rank whose collective timed out waits for the others to say so through the store:
// half the collective timeout, between 1 and 5 seconds.
std::chrono::milliseconds diagnosis_window(const DataParallelConfig& flags) {
  return std::chrono::milliseconds(std::clamp(flags.dist_timeout_s * 500, 1000, 5000));
}

}  // namespace

int run_data_parallel_worker(const DataParallelConfig& flags, const dp::WorkerEnv& env) {
  const RunConfig& f = flags.run;
  const Device device = worker_device(flags, env.local_rank);
  const int local_world = std::max(1, std::atoi(env_or("LOCAL_WORLD_SIZE", std::to_string(env.world_size)).c_str()));
  const int threads = f.threads_per_device > 0 ? f.threads_per_device : default_threads_per_device(local_world);
  at::set_num_threads(threads);

  dp::DistOptions options = dp::dist_options_for(env, flags.backend, device);
  options.timeout = std::chrono::seconds(flags.dist_timeout_s);
  options.debug_sync = flags.debug_sync;
  // T > 1: this rank holds 1/T of a model replica; its data-parallel group (the ranks holding the
  // same shard) is what the batch is partitioned over and the gradients are averaged over.
  const parallel::Layout layout = run_layout(flags, env.world_size);
  (void)layout.coordinates_of(env.rank);  // a rank outside the world is refused before connecting
  check_zero_stage(flags);
  check_elastic_run(flags, env.world_size);
  // Under torchrun each host's agent watches only its own workers and lets the others run on; a
  // lost host takes its agent with it, so the workers beat through the agent's store and read a
  // beat that stands still as a loss (elastic_rendezvous.h). srun ends a step when one task fails.
  const bool our_launcher = !env_or(kElasticLaunchVariable, "").empty();
  const bool torchrun = !env_or("TORCHELASTIC_RUN_ID", "").empty();
  if (flags.elastic && !our_launcher && !torchrun) {
    throw std::invalid_argument(
        "--elastic needs run_data_parallel's own launcher or torchrun: they hold the rendezvous store apart "
        "from the workers, and let the other workers go on when one is lost, whereas this launcher (srun?) "
        "ends every task when one fails; here, use --max_restarts (or the launcher's restarts) with --resume auto");
  }
  // A replacement the launcher started for a lost worker joins the run under way: the store
  // alone, until the others admit it.
  const std::string join_id = flags.elastic ? env_or(dp::kElasticJoinIdVariable, "") : "";
  const dp::DistContext world =
      join_id.empty() ? dp::init_process_group(options) : dp::connect_rendezvous_store(options);
  const std::string host = host_label(options);
  record_host(host, world);
  const std::unique_ptr<dp::Heartbeat> heartbeat =
      flags.elastic && !our_launcher ? std::make_unique<dp::Heartbeat>(dp::open_store_client(options), env.rank)
                                     : nullptr;
  try {
    return train_this_rank(flags, layout, env, device, threads, options, world,
                           join_id.empty() ? -1 : std::stoi(join_id));
  } catch (const AgreedStop&) {
    throw;  // every rank says the same
  } catch (const dp::RunEndedError& e) {
    std::cerr << e.what() << "; nothing to do" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    // Under --elastic the store is what the survivors agree through: without it none goes on.
    const std::string store_address = options.master_addr + ":" + std::to_string(options.master_port);
    if (flags.elastic && !store_reachable(world, diagnosis_window(flags))) {
      const std::string what = e.what();
      throw std::runtime_error(
          "the rendezvous store at " + store_address + " cannot be reached from this rank (" + host +
          "): under --elastic the store is the run's one single point of failure, and the host that holds it (" +
          (our_launcher ? std::string("the launcher's") : std::string("MASTER_ADDR's, torchrun's agent")) +
          ") is lost or cut off from this one, so the run cannot go on here (" + what.substr(0, what.find('\n')) +
          ")");
    }
    // A collective that failed for want of a peer: who answers through the store, who stopped with
    // a reason, and who is behind a cut link. A peer that finds this rank gone then reads that.
    const CollectiveDiagnosis failure =
        explain_failed_collective(e.what(), world, host, store_address, diagnosis_window(flags));
    if (failure.message != e.what()) {
      if (failure.reached_store) record_stop(failure.message, world);
      // Rank 0 may serve the store: it stays a moment, so that the others finish reading it.
      if (world.rank == 0) std::this_thread::sleep_for(std::chrono::seconds(1));
      throw std::runtime_error(failure.message);
    }
    // A peer that finds this rank gone reads why in the store; this rank, finding a peer gone,
    // names it rather than repeating the transport's words.
    record_stop(e.what(), world);
    throw std::runtime_error(explain_stop(e.what(), world));
  }
}

}  // namespace harness::train
