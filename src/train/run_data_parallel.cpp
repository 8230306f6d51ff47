// run_data_parallel's worker (see run_data_parallel.h): one rank's process group, data partition, model
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
#include "harness/model/safetensors.h"
#include "harness/parallel/layout.h"
#include "harness/parallel/process_groups.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/trace.h"
#include "harness/train/step/context_parallel_step.h"
#include "harness/train/plan/memory_plan.h"
#include "harness/train/step/pipeline_forward_backward.h"
#include "harness/train/run_data_parallel.h"
#include "harness/train/rank_agreement.h"
#include "harness/train/step/build_step.h"
#include "harness/train/elastic/elastic_step.h"
#include "harness/zero/zero.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;
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

// The positions each sequence is padded to: --model_max_length, or with C > 1 a multiple of 2C
// (of 2C * T, or of T when C = 1, with --sequence_parallel), which must still fit the model's
// position table.
int64_t padded_sequence_length(const DataParallelConfig& flags, const model::GPT2Config& config) {
  const int C = flags.plan.context_parallel_size;
  const int T = flags.plan.sequence_parallel ? flags.plan.tensor_parallel_size : 1;
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
MemoryPlanInput plan_input(const DataParallelConfig& flags, const model::GPT2Config& config, int64_t replica_rows,
                           int64_t sequence_length) {
  const RunConfig& f = flags.run;
  const int C = flags.plan.context_parallel_size, P = flags.plan.pipeline_parallel_size;
  MemoryPlanInput in;
  in.program = "run_data_parallel";
  in.model_name = f.model.path.empty() ? f.model.preset : f.model.path;
  in.config = config;
  in.plan = flags.plan;
  // With C > 1 the D x C ranks of a slice share its state (ZeRO shards over them), while each
  // replica's rows are split along the sequence: S / C positions a rank.
  in.rows_per_replica = replica_rows;
  in.tokens = sequence_length / C;
  in.bf16 = f.precision == model::Precision::kBf16;
  if (P > 1) {
    plan_stages(in, P, balanced_pipeline_options(flags.plan.pipeline, P, /*processes=*/true, config, replica_rows, sequence_length),
                flags.plan.pipeline.balance.automatic);
  }
  return in;
}

// The stages' options from the pipeline flags (checked, the flags named), for P > 1 and a replica
// batch of `replica_batch` rows; the balance numbers are checked against the model's blocks here too.
PipelineStepOptions stage_options(const DataParallelConfig& flags, const model::GPT2Config& config,
                                  int64_t replica_batch) {
  const int P = flags.plan.pipeline_parallel_size;
  const PipelineScheduleConfig& pipe = flags.plan.pipeline;
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

void check_elastic_run(const DataParallelConfig& flags) {
  if (!flags.plan.elastic) return;
  if (flags.save_every_rank) {
    throw std::invalid_argument("--save_every_rank with --elastic: the replicas hold the same weights, and the "
                                "current rank 0 saves them to --workdir");
  }
  if (flags.pytest) throw std::invalid_argument("--pytest with --elastic: --pytest trains one step, nothing to recover");
}

void check_data_parallel_run(const DataParallelConfig& flags) {
  const RunConfig& f = flags.run;
  flags.plan.validate();
  check_elastic_run(flags);
  const int64_t replica_batch = dp::per_device_batch_size(f.batch_size, flags.plan.data_parallel_size());
  dp::resolve_backend(flags.backend, worker_device(flags, flags.plan.world_size - 1));
  check_writable_folder(f.workdir, "--workdir");
  if (flags.pytest) check_writable_folder(flags.grad_dir, "--grad_dir");
  load_corpus(f.dataset, f.sizes, f.seed, f.sizes_given);
  const model::GPT2Config config = resolve_config(f.model);
  shipped_tokenizer(f.model, config);
  check_positions(config, f.model_max_length);
  const int64_t sequence_length = padded_sequence_length(flags, config);
  if (flags.plan.pipeline_parallel_size > 1) (void)stage_options(flags, config, replica_batch);
  if (flags.plan.tensor_parallel_size > 1) model::validate_tensor_parallel(config, flags.plan.tensor_parallel_size);
  // Each rank's model state against the memory each has on this machine, before any weight is read.
  check_model_state_fits(plan_memory(plan_input(flags, config, replica_batch, sequence_length)),
                         available_memory(data_parallel_devices(flags.device, flags.plan.world_size),
                                          /*release_gpu_context=*/true),
                         [&flags](int stage) -> std::string {
                           Plan other = flags.plan;
                           other.zero.stage = stage;
                           try {
                             other.validate();
                           } catch (const std::invalid_argument& e) {
                             return e.what();
                           }
                           return std::string();
                         });
  // config.json against model.safetensors: the weights are read and checked as a worker would.
  if (!f.model.path.empty()) build_model(f.model, config, f.seed);
}

int print_memory_plan(const DataParallelConfig& flags) {
  // The sizes as a run checks them (the flags named); the ZeRO stage and sequence parallelism are
  // planned even where this build cannot run them, and said so below.
  Plan sizes = flags.plan;
  sizes.sequence_parallel = false;
  (void)sizes.layout();
  const RunConfig& f = flags.run;
  const Plan& plan = flags.plan;
  const int64_t sequence_length = split_sequence_length(f.model_max_length, plan.context_parallel_size,
                                                        plan.sequence_parallel ? plan.tensor_parallel_size : 1);
  const MemoryPlan memory = plan_memory(plan_input(flags, resolve_config(f.model),
                                                   dp::per_device_batch_size(f.batch_size, plan.data_parallel_size()),
                                                   sequence_length));
  std::vector<Device> devices = data_parallel_devices(flags.device, plan.world_size);
  if (devices.front().is_cuda() && static_cast<int>(torch::cuda::device_count()) < plan.world_size) {
    devices.resize(std::max<size_t>(1, torch::cuda::device_count()));  // the plan still prints
  }
  std::cout << format_memory_plan(memory, available_memory(devices)) << std::flush;
  try {
    plan.validate();
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

// What one rank of run_data_parallel works with, built once in run_data_parallel_worker and
// passed whole: its flags, how it was started, and its place in the run.
struct Worker {
  const DataParallelConfig& flags;
  const dp::WorkerEnv& env;
  RankContext rank;  // the plan, this rank, its groups, its device, the launch's world
  int threads = 1;
  int join_id = -1;  // under --elastic, a replacement's launch id (it joins the run under way)
  bool joining() const { return join_id >= 0; }
};

// The step's parts as the flags choose them. P > 1: this rank's stage options (--balance auto is
// timed by build_step; a replacement reads the balance the run agreed on at its start). Each
// data-parallel replica draws its own dropout masks, the same on every stage of it.
StepComposition rank_composition(const Worker& w, const RankInputs& in, Tracer* tracer) {
  const DataParallelConfig& flags = w.flags;
  StepComposition composition;
  composition.optimizer = flags.run.optimizer_settings();
  // (Under --elastic no stage steps before the others are known alive: post-validation is off.)
  composition.optimizer.post_validate = !flags.synchronous_step && !flags.plan.elastic;
  composition.debug_sync = flags.debug_sync;
  if (flags.plan.pipeline_parallel_size == 1) return composition;
  PipelineStepOptions stage = stage_options(flags, in.config, in.rows);
  stage.devices = {w.rank.device};
  stage.seed = flags.run.seed + static_cast<uint64_t>(w.rank.coordinates().data);
  stage.tracer = tracer;  // each stage action a slice on the rank's trace
  if (flags.plan.pipeline.balance.automatic && w.joining()) {
    const std::vector<uint8_t> text = w.rank.world.store->get(kAgreedBalanceKey);
    std::istringstream halves(std::string(text.begin(), text.end()));
    for (int h = 0; halves >> h;) stage.balance_halves.push_back(h);
  }
  composition.stages = stage;
  composition.balance_rows = std::max<int64_t>(1, in.rows / stage.micro_batches);
  composition.balance_tokens = flags.run.model_max_length;
  return composition;
}

// Under --elastic rank 0 leaves the agreed --balance auto in the store, for replacements, which time nothing.
void leave_agreed_balance(const Worker& w, const std::vector<int>& halves) {
  if (!w.flags.plan.elastic || !w.flags.plan.pipeline.balance.automatic || w.rank.rank != 0 || w.joining()) return;
  std::string text;
  for (const int h : halves) text += std::to_string(h) + " ";
  w.rank.world.store->set(kAgreedBalanceKey, std::vector<uint8_t>(text.begin(), text.end()));
}

// Rank 0's lines before training: the run, the layout's table and the memory plan.
void print_run(const Worker& w, const BuiltStep& built, const RankInputs& in) {
  const DataParallelConfig& flags = w.flags;
  const dp::WorkerEnv& env = w.env;
  const Device& device = w.rank.device;
  const parallel::Layout layout = w.rank.layout();
  model::GPT2LMHeadModel model = built.model;
  const int threads = w.threads;
  const dp::Backend backend = w.rank.groups.gradient.backend;
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
            << " grad_sync=" << dp::to_string(flags.plan.gradient_sync.kind) << " allreduce=" << dp::to_string(flags.plan.gradient_sync.allreduce)
            << " reshuffle_each_epoch=" << (flags.reshuffle_each_epoch ? "true" : "false")
            << " precision=" << model::to_string(f.precision) << " grad_reduce_dtype=" << (flags.plan.gradient_sync.reduce_dtype == at::kBFloat16 ? "bf16" : "fp32")
            << " zero_stage=" << flags.plan.zero.stage << (flags.debug_sync ? " debug_sync=true" : "")
            << (f.gradient_accumulation_steps > 1
                    ? " gradient_accumulation_steps=" + std::to_string(f.gradient_accumulation_steps)
                    : "");
  if (flags.plan.elastic) std::cerr << " elastic=true min_replicas=" << flags.plan.min_replicas;
  if (T > 1) std::cerr << " tensor_parallel_size=" << T << " data_parallel_size=" << dp_size;
  if (layout.sequence_parallel()) std::cerr << " sequence_parallel=true";
  if (const int C = layout.context_parallel_size(); C > 1) {
    std::cerr << " context_parallel_size=" << C << (T > 1 ? "" : " data_parallel_size=" + std::to_string(dp_size))
              << " sequence_length=" << in.sequence_length << " (" << in.sequence_length / C << " positions per rank)";
  }
  if (const PipelineForwardBackward* stages = built.stages) {
    std::cerr << " pipeline_parallel_size=" << P << " data_parallel_size=" << dp_size
              << " pipeline_schedule=" << pipeline::to_string(flags.plan.pipeline.schedule) << " n_chunk=" << flags.plan.pipeline.n_chunk
              << " virtual_stages=" << pipeline::chunks_per_device(flags.plan.pipeline.schedule, flags.plan.pipeline.virtual_stages)
              << " stages=" << stages->stages()
              << " balance=" << stages->balance_text()
              << pipeline::balance_origin(flags.plan.pipeline.balance, /*pipelined=*/true)
              << " activation_checkpointing=" << pipeline::to_string(flags.plan.pipeline.activation_checkpointing);
    if (pipeline::splits_backward(flags.plan.pipeline.schedule)) {
      std::cerr << " post_validation=" << (flags.synchronous_step ? "false" : "true");
    }
  }
  std::cerr << std::endl
            << layout.coordinates_table(flags.plan.zero.stage ? ", ZeRO stage " + std::to_string(flags.plan.zero.stage) : "")
            << std::flush;
  try {
    const int ranks_here = std::max(1, std::atoi(env_or("LOCAL_WORLD_SIZE", std::to_string(env.world_size)).c_str()));
    const std::vector<Device> here = device.is_cuda() ? std::vector<Device>{device} : std::vector<Device>(ranks_here, device);
    std::cerr << "run_data_parallel: "
              << memory_plan_line(plan_memory(plan_input(flags, model->config(), in.rows, in.sequence_length)),
                                  available_memory(here))
              << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "run_data_parallel: memory plan: not made: " << e.what() << std::endl;
  }
}

// Rank 0's lines after training: what ZeRO-3 gathered at once and what the synchronizer sent.
void print_after_training(const DataParallelConfig& flags, const dp::GradientSynchronizer* sync) {
  if (const std::string zero3 = zero::zero3_peak_line(flags.plan, sync); !zero3.empty()) std::cerr << zero3 << std::endl;
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
  training.plan = flags.plan;
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

// Under --elastic: how the step recovers (elastic_step.h), the dropped replicas' batches read
// from their loaders' mirror.
struct ElasticParts {
  std::unique_ptr<ReplicaBatchMirror> mirror;
  ElasticSettings settings;
};

std::optional<ElasticParts> elastic_parts(const Worker& w, const RankLoaders& loaders) {
  if (!w.flags.plan.elastic) return std::nullopt;
  ElasticParts parts;
  parts.mirror = std::make_unique<ReplicaBatchMirror>([&loaders](int replica) { return loaders.shard_of(replica); });
  parts.settings.plan = w.flags.plan;
  // The launcher's replacements (their count: its option) take dropped replicas back whole.
  parts.settings.accept_joiners = true;
  parts.settings.join_id = w.join_id;
  // A survivor blocked in a collective with another survivor learns of the loss when the
  // collective times out, and the launcher declares a stopped process lost a little later.
  parts.settings.join_window = std::chrono::seconds(w.flags.dist_timeout_s + 15);
  return parts;
}

// This rank's step (build_step.h). The model, split over its tensor-parallel group from the start
// (each rank builds and loads its own slices), starts from rank 0's weights on every rank that
// holds the same slices (a replacement: from the weights the others send it as it joins).
BuiltStep build_rank_step(const Worker& w, const RankInputs& in, const StepComposition& composition,
                          const TrainStepSettings& settings, const std::optional<ElasticParts>& elastic) {
  const RunConfig& f = w.flags.run;
  const MakeModel make_model = [&](std::shared_ptr<model::TensorParallelGroup> split) {
    model::GPT2LMHeadModel model = build_model(f.model, in.config, f.seed, std::move(split));
    model->to(w.rank.device.torch_device());
    if (!w.joining()) broadcast_parameters(w.rank.groups.gradient, *model);
    return model;
  };
  std::optional<ElasticStepSource> source;
  if (elastic) source = ElasticStepSource{elastic->mirror.get(), &elastic->settings};
  BuiltStep built = build_step(w.rank, make_model, composition, settings, source);
  leave_agreed_balance(w, built.balance_halves);
  // Dropout differs per data-parallel rank, as it would in PyTorch's DDP with one seed per
  // process; the ranks of one tensor-parallel group share the seed, so that they draw the same
  // masks on the activations they all hold (Megatron does the same for its replicated regions;
  // attention dropout on each rank's own heads draws from a stream of its own, parallel_rng.h).
  // The ranks of a context group hold different positions: each draws its own masks.
  const parallel::Layout layout = w.rank.layout();
  const int C = layout.context_parallel_size(), D = layout.data_parallel_size();
  const parallel::Coordinates here = w.rank.coordinates();
  torch::manual_seed(f.seed + static_cast<uint64_t>(here.data * C + here.context));
  if (const auto joined = built.elastic ? built.elastic->joined_at() : std::nullopt) {
    // Its own dropout stream, unlike any other replica's or replacement's (the lost one's
    // cannot be recovered), the same on the tensor ranks of its replica (they join together).
    torch::manual_seed(f.seed + static_cast<uint64_t>((here.data + (joined->global_step + 1) * D) * C + here.context));
  }
  return built;
}

// What the driver trains on: this rank's loaders, and under --elastic how it follows the membership.
TrainingData rank_training_data(const RankInputs& in, RankLoaders& loaders, BuiltStep& built,
                                const std::optional<ElasticParts>& elastic, TrainingOptions& training) {
  TrainingData data;
  data.train = [&loaders](int64_t epoch) -> data::BatchLoader& { return loaders.train->set_epoch(epoch); };
  data.validation = &loaders.validation;
  data.test = &in.corpus.test;
  data.tokenizer = &*in.tokenizer;
  if (ElasticTrainStep* step = built.elastic.get()) {
    training.elastic = true;
    training.peers_alive = [step] { step->trainer().check_members_alive(); };
    training.keeps_metrics = [step] { return step->trainer().keeps_the_log(); };
    training.lost_peer = [](const std::exception& e) {
      return is_communication_failure(e) || dynamic_cast<const LostProcessError*>(&e) != nullptr;
    };
    ReplicaBatchMirror* mirror = elastic->mirror.get();
    data.epoch_started = [mirror](int64_t epoch, int64_t first_batch) { mirror->start_epoch(epoch, first_batch); };
    data.membership_changes = [step] { return step->take_membership_changes(); };
    training.joined_at = step->joined_at();
  }
  return data;
}

// Training (or, with --pytest, one step's gradients written), then this rank's lines after it.
void train_rank(const Worker& w, const RankInputs& in, RankLoaders& loaders, BuiltStep& built,
                const std::optional<ElasticParts>& elastic, Tracer* tracer, const dp::DistContext& current_world) {
  const DataParallelConfig& flags = w.flags;
  const RunConfig& f = flags.run;
  const int rank = w.env.rank;
  if (flags.pytest) {
    // One batch (or --gradient_accumulation_steps of them): forward, backward, averaged
    // gradients, written before any optimizer step.
    const std::string path = flags.grad_dir + "/model" + std::to_string(rank) + "_gradients.pth";
    write_gradients_of_one_step(built.step(), loaders.train->set_epoch(0), path, f.gradient_accumulation_steps);
    std::cout << "Rank " << rank << ": wrote " << path << std::endl;
    return;
  }
  TrainingOptions training = rank_training_options(flags, w.rank.layout(), w.env, w.rank.device, in);
  training.tracer = tracer;
  training.trace_track = "rank " + std::to_string(rank);
  const TrainingData data = rank_training_data(in, loaders, built, elastic, training);
  run_training(built.step(), data, training, &current_world);
  record_weight_digest_if_asked(built.model, built.elastic ? built.elastic->trainer().launch_rank() : rank);
  if (built.plain) {
    if (rank == 0) print_after_training(flags, built.sync.get());
    if (const StepOptimizer::PostValidation pv = built.plain->optimizer().post_validation(); pv.early > 0) {
      std::cerr << "[rank " << rank << "] optimizer: post-validation stepped " << pv.early
                << " times before the global norm arrived, " << pv.undone << " of them undone (clipped or skipped)"
                << std::endl;
    }
  }
  if (tracer) write_trace(*tracer, f.trace, w.env);
  if (current_world.rank == 0) {
    std::cerr << "run_data_parallel: model, tokenizer and results are in " << f.workdir << std::endl;
  }
}

// A replacement (w.joining()) has the store alone for a world: it joins the run under way and
// receives its state.
int train_this_rank(Worker& w) {
  const DataParallelConfig& flags = w.flags;
  const RunConfig& f = flags.run;
  const int rank = w.env.rank;
  RankInputs in;
  in.rows = dp::per_device_batch_size(f.batch_size, flags.plan.data_parallel_size());
  prepare_rank_inputs(flags, rank, w.rank.world, w.joining(), in);
  if (!w.joining()) w.rank.groups = parallel::make_process_groups(w.rank.world, w.rank.options, w.rank.layout());

  std::unique_ptr<Tracer> tracer = f.trace.empty() ? nullptr : std::make_unique<Tracer>();
  const StepComposition composition = rank_composition(w, in, tracer.get());
  TrainStepSettings settings;
  settings.precision = f.precision;
  settings.tracer = tracer.get();
  settings.trace_track = "rank " + std::to_string(rank);
  RankLoaders loaders(flags, w.rank.layout(), rank, in);
  const std::optional<ElasticParts> elastic = elastic_parts(w, loaders);
  BuiltStep built = build_rank_step(w, in, composition, settings, elastic);
  if (built.plain && flags.plan.zero.stage >= 1 && rank == 0) {
    std::cerr << zero::zero_state_line(flags.plan, built.model, built.plain->optimizer()) << std::endl;
  }
  if (rank == 0 && !w.joining()) print_run(w, built, in);
  // The world the run's collectives and checkpoints go over: the current generation's under --elastic.
  const dp::DistContext& current_world = built.elastic ? built.elastic->world() : w.rank.world;
  train_rank(w, in, loaders, built, elastic, tracer.get(), current_world);
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

// Why a rank's training failed, said in the words every rank can agree on, and thrown: under
// --elastic a store out of reach; a collective that failed for want of a peer, who answers and
// who is behind a cut link; else the peer that stopped first, named.
[[noreturn]] void explain_failure(const std::exception& e, const DataParallelConfig& flags,
                                  const dp::DistOptions& options, const dp::DistContext& world, const std::string& host,
                                  bool our_launcher) {
  // Under --elastic the store is what the survivors agree through: without it none goes on.
  const std::string store_address = options.master_addr + ":" + std::to_string(options.master_port);
  if (flags.plan.elastic && !store_reachable(world, diagnosis_window(flags))) {
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

}  // namespace

int run_data_parallel_worker(const DataParallelConfig& config, const dp::WorkerEnv& env) {
  DataParallelConfig flags = config;
  flags.plan.world_size = env.world_size;  // under torchrun or Slurm, theirs
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
  flags.plan.validate();
  check_elastic_run(flags);
  const parallel::Layout layout = flags.plan.layout();
  (void)layout.coordinates_of(env.rank);  // a rank outside the world is refused before connecting
  // Under torchrun each host's agent watches only its own workers and lets the others run on; a
  // lost host takes its agent with it, so the workers beat through the agent's store and read a
  // beat that stands still as a loss (elastic_rendezvous.h). srun ends a step when one task fails.
  const bool our_launcher = !env_or(kElasticLaunchVariable, "").empty();
  const bool torchrun = !env_or("TORCHELASTIC_RUN_ID", "").empty();
  if (flags.plan.elastic && !our_launcher && !torchrun) {
    throw std::invalid_argument(
        "--elastic needs run_data_parallel's own launcher or torchrun: they hold the rendezvous store apart "
        "from the workers, and let the other workers go on when one is lost, whereas this launcher (srun?) "
        "ends every task when one fails; here, use --max_restarts (or the launcher's restarts) with --resume auto");
  }
  // A replacement the launcher started for a lost worker joins the run under way: the store
  // alone, until the others admit it.
  const std::string join_id = flags.plan.elastic ? env_or(dp::kElasticJoinIdVariable, "") : "";
  const dp::DistContext world =
      join_id.empty() ? dp::init_process_group(options) : dp::connect_rendezvous_store(options);
  const std::string host = host_label(options);
  record_host(host, world);
  const std::unique_ptr<dp::Heartbeat> heartbeat =
      flags.plan.elastic && !our_launcher ? std::make_unique<dp::Heartbeat>(dp::open_store_client(options), env.rank)
                                     : nullptr;
  Worker w{flags, env, RankContext{}, threads, join_id.empty() ? -1 : std::stoi(join_id)};
  w.rank.plan = flags.plan;
  w.rank.rank = env.rank;
  w.rank.device = device;
  w.rank.options = options;
  w.rank.world = world;
  try {
    return train_this_rank(w);
  } catch (const AgreedStop&) {
    throw;  // every rank says the same
  } catch (const dp::RunEndedError& e) {
    std::cerr << e.what() << "; nothing to do" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    explain_failure(e, flags, options, world, host, our_launcher);
  }
}

}  // namespace harness::train
