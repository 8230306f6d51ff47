// run_data_parallel's worker (see programs.h): one rank's process group, data partition, model
// (whole, or its tensor-parallel shard) and gradient synchronisation, trained by the driver.
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/debug_sync.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/partition.h"
#include "harness/data_parallel/process_group.h"
#include "harness/data_parallel/sharded_loader.h"
#include "harness/data_parallel/zero.h"
#include "harness/data_parallel/zero3.h"
#include "harness/context_parallel/group.h"
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
#include "harness/train/zero3_step.h"

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
parallel::Layout run_layout(const DataParallelConfig& flags, int world_size) {
  parallel::LayoutSizes sizes;
  sizes.tensor = flags.tensor_parallel_size;
  sizes.context = flags.context_parallel_size;
  sizes.pipeline = flags.pipeline_parallel_size;
  sizes.zero_stage = flags.zero_stage;
  const parallel::Layout layout = parallel::Layout::create(world_size, sizes);
  if (layout.context_parallel_size() > 1 && layout.pipeline_parallel_size() > 1) {
    throw std::invalid_argument("--context_parallel_size " + std::to_string(layout.context_parallel_size()) +
                                " cannot be combined with --pipeline_parallel_size " +
                                std::to_string(layout.pipeline_parallel_size()) +
                                ": the pipeline stages do not run ring attention; use one of the two");
  }
  return layout;
}

// With C > 1 each sequence is padded to a multiple of 2C positions, which must still fit the
// model's position table.
void check_context_parallel_length(const DataParallelConfig& flags, const model::GPT2Config& config) {
  const int C = flags.context_parallel_size;
  if (C <= 1) return;
  const int64_t padded = context_parallel_length(flags.run.model_max_length, C);
  if (padded > config.n_positions) {
    throw std::invalid_argument("--context_parallel_size " + std::to_string(C) + " pads --model_max_length " +
                                std::to_string(flags.run.model_max_length) + " to " + std::to_string(padded) +
                                " positions (a multiple of 2C = " + std::to_string(2 * C) +
                                "), more than the model's n_positions " + std::to_string(config.n_positions) +
                                ": lower --model_max_length to a multiple of " + std::to_string(2 * C));
  }
}

// The stages' options from the pipeline flags (checked, the flags named), for P > 1; the balance
// numbers are checked against the model's blocks here too.
PipelineStepOptions stage_options(const DataParallelConfig& flags, const parallel::Layout& layout,
                                  const model::GPT2Config& config) {
  const int P = layout.pipeline_parallel_size();
  const int64_t replica_batch = data_parallel::per_device_batch_size(flags.run.batch_size, layout.data_parallel_size());
  const PipelineScheduleConfig& pipe = flags.pipe;
  if (pipe.n_chunk < 1 || pipe.n_chunk > replica_batch) {
    throw std::invalid_argument("--n_chunk " + std::to_string(pipe.n_chunk) + " must be between 1 and the " +
                                std::to_string(replica_batch) + " rows each data-parallel replica trains on");
  }
  PipelineStepOptions options = pipeline_step_options(pipe, P);
  // "auto" is timed on the model later; the timed balance goes through the same check there.
  if (!pipeline::parse_balance(pipe.balance).automatic) {
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
  if (flags.grad_sync != "bucketed") {
    throw std::invalid_argument("--zero_stage " + std::to_string(flags.zero_stage) +
                                " reduce-scatters gradient buckets: it needs --grad_sync bucketed, not " + flags.grad_sync);
  }
  if (flags.allreduce != dp::AllReduceAlgorithm::kBuiltin) {
    throw std::invalid_argument("--zero_stage " + std::to_string(flags.zero_stage) +
                                " reduce-scatters with the process group's collectives: it cannot take --allreduce ring");
  }
}

void check_data_parallel_run(const DataParallelConfig& flags) {
  const RunConfig& f = flags.run;
  const parallel::Layout layout = run_layout(flags, flags.world_size);
  check_zero_stage(flags);
  dp::per_device_batch_size(f.batch_size, layout.data_parallel_size());
  dp::resolve_backend(flags.backend, worker_device(flags, flags.world_size - 1));
  check_writable_folder(f.workdir, "--workdir");
  if (flags.pytest) check_writable_folder(flags.grad_dir, "--grad_dir");
  load_corpus(f.dataset, f.sizes, f.seed, f.sizes_given);
  const model::GPT2Config config = resolve_config(f.model);
  shipped_tokenizer(f.model, config);
  check_positions(config, f.model_max_length);
  check_context_parallel_length(flags, config);
  if (layout.pipeline_parallel_size() > 1) (void)stage_options(flags, layout, config);
  if (flags.tensor_parallel_size > 1) model::validate_tensor_parallel(config, flags.tensor_parallel_size);
  // Each rank's model state against the memory each has on this machine, before any weight is read.
  check_model_state_fits(plan_memory(memory_plan_input(flags, config)),
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

namespace {

// Test hook: the rank named drops its last training pair, as a rank reading another copy of the
// dataset would, so that the ranks' tokenizers and training splits differ.
void apply_training_split_test_hook(int rank, std::vector<data::TranslationExample>& train) {
  const char* hook = std::getenv("HARNESS_TEST_DROP_TRAINING_PAIR_ON_RANK");
  if (hook != nullptr && *hook != '\0' && std::atoi(hook) == rank && !train.empty()) train.pop_back();
}

int train_this_rank(const DataParallelConfig& flags, const parallel::Layout& layout, const dp::WorkerEnv& env,
                    const Device& device, int threads, const dp::DistOptions& options, const dp::DistContext& world) {
  const RunConfig& f = flags.run;
  const int rank = env.rank;
  const int T = flags.tensor_parallel_size;
  const int C = layout.context_parallel_size(), cp_rank = layout.coordinates_of(rank).context;
  const int dp_rank = layout.coordinates_of(rank).data, dp_size = layout.data_parallel_size();
  const int64_t device_batch = dp::per_device_batch_size(f.batch_size, dp_size);

  // Every rank trains its own tokenizer; only rank 0 keeps the file, so the ranks need no shared
  // folder when they span machines. They must have trained the same one: checked below.
  const std::string tokenizer_path =
      rank == 0 ? f.workdir + "/tokenizer.model"
                : (fs::temp_directory_path() / ("harness-tokenizer-" + std::to_string(::getpid()) + ".model")).string();
  // Rank r > 0 keeps its copy of the tokenizer until the driver has compared it with a checkpoint's.
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() {
      if (!path.empty()) ::unlink(path.c_str());
    }
  } temporary_tokenizer{rank != 0 ? tokenizer_path : std::string()};
  data::TranslationCorpus corpus;
  model::GPT2Config config;
  std::optional<data::Tokenizer> prepared;
  // What one rank may find wrong on its own machine (its folder, its copy of the dataset) stops
  // every rank with the same reason.
  std::string refusal;
  try {
    check_writable_folder(f.workdir, "--workdir");
    corpus = load_corpus(f.dataset, f.sizes, f.seed, f.sizes_given);
    apply_training_split_test_hook(rank, corpus.train);
    config = resolve_config(f.model);
    prepared.emplace(prepare_tokenizer(f.model, config, corpus.train, tokenizer_path));
    check_context_parallel_length(flags, config);
  } catch (const std::exception& e) {
    refusal = e.what();
  }
  agree_to_go_on(refusal, &world);
  check_ranks_share_tokenizer(tokenizer_fingerprint(corpus.train, tokenizer_path), &world);
  data::Tokenizer tokenizer = std::move(*prepared);
  if (f.fit_vocab) fit_vocabulary(config, f.model, tokenizer);
  if (rank == 0) config.save_json_file(f.workdir + "/config.json");  // as the original, at start

  const int P = layout.pipeline_parallel_size();
  const parallel::ProcessGroups groups = parallel::make_process_groups(world, options, layout);
  // The ranks holding the same slice of the model: what the gradients are averaged over.
  const dp::DistContext& ctx = groups.gradient;

  // T > 1: the model is split over the tensor-parallel group from the start (each rank builds
  // and loads its own slices).
  std::shared_ptr<model::TensorParallelGroup> split = T == 1 ? nullptr : tp::make_tensor_parallel_group(groups.tensor);
  model::GPT2LMHeadModel model = build_model(f.model, config, f.seed, split);
  model->to(device.torch_device());
  broadcast_parameters(ctx, *model);
  // C > 1: every rank of a context group holds the whole replica (its tensor-parallel slices) and
  // runs its zigzag shard of each sequence, attention passing keys and values round the group.
  if (C > 1) model->set_context_parallel(context_parallel::make_context_parallel_group(groups.context));
  // The step's parts, chosen once. How forward and backward run: the whole model here, or this
  // rank's pipeline stages, the others' activations and gradients coming by send/recv.
  std::unique_ptr<ForwardBackward> forward_backward;
  PipelineForwardBackward* pipeline_stages = nullptr;
  // --zero_stage 1 and 2: the gradient buckets are reduce-scattered over the data-parallel group (of the
  // whole model, of each tensor-parallel shard, or of each pipeline stage), and each rank's AdamW
  // steps its chunks. A stage holding the tied wte gives it a bucket of its own, so that the first
  // and the last stage's chunks of it are the same elements, summed over the embedding group.
  // --zero_stage 2: each rank keeps only its chunks of the gradients too (the full ones let go as
  // they are reduce-scattered, a step's batches accumulated into the chunks).
  std::unique_ptr<dp::BucketedAllReduce> zero_buckets;
  if (flags.zero_stage == 1 || flags.zero_stage == 2) {
    zero_buckets = std::make_unique<dp::BucketedAllReduce>(
        ctx, flags.bucket_cap_mb, flags.allreduce,
        flags.zero_stage == 2 ? dp::GradientReduction::kShardedGradients : dp::GradientReduction::kReduceScatter);
  }
  if (P > 1) {
    PipelineStepOptions stage = stage_options(flags, layout, config);
    stage.devices = {device};
    // Each data-parallel replica draws its own dropout masks, the same on every stage of it.
    stage.seed = f.seed + static_cast<uint64_t>(dp_rank);
    if (pipeline::parse_balance(flags.pipe.balance).automatic) {
      // Every rank times GPT-2's pieces; rank 0's balance is everyone's.
      const int64_t rows = std::max<int64_t>(1, device_batch / stage.micro_batches);
      std::vector<int> halves = pipeline::balance_gpt2_by_time(model, device, P * stage.virtual_stages, rows,
                                                               f.model_max_length);
      at::Tensor agreed = torch::tensor(std::vector<int64_t>(halves.begin(), halves.end()), torch::kLong)
                              .to(device.torch_device());
      std::vector<at::Tensor> tensors{agreed};
      world.group->broadcast(tensors)->wait();
      agreed = agreed.to(torch::kCPU);
      stage.balance_halves.assign(agreed.data_ptr<int64_t>(), agreed.data_ptr<int64_t>() + agreed.numel());
    }
    PipelineProcesses processes{groups.pipeline, groups.embedding, flags.debug_sync, {}};
    if (zero_buckets && groups.embedding) {
      const at::Tensor wte = model->transformer->wte->weight;
      zero_buckets->keep_apart(wte);
      processes.tied_gradient = [buckets = zero_buckets.get(), wte] { return buckets->gradient_shard_of(wte); };
    }
    auto made = std::make_unique<PipelineForwardBackward>(model, stage, std::move(processes));
    pipeline_stages = made.get();
    forward_backward = std::move(made);
  } else if (flags.zero_stage != 3) {
    forward_backward = whole_model(model);
  }
  // How gradients are averaged and how the optimizer steps: ZeRO-1 shards AdamW over the buckets
  // its reduce-scattering synchronizer hands it; a pipeline stage's AdamW steps its stage's
  // parameters, averaged over the stage's data-parallel group (sharded over it with ZeRO-1);
  // otherwise every rank's AdamW steps what its synchronizer averaged.
  std::unique_ptr<dp::GradientSynchronizer> sync;
  std::unique_ptr<StepOptimizer> optimizer;
  if (pipeline_stages) {
    PipelineStageParameters held;
    held.held = pipeline_stages->held_parameters();
    for (const auto& item : model->named_parameters()) held.owner[item.key()] = pipeline_stages->owner_of(item.key());
    held.pipeline = groups.pipeline;
    std::vector<at::Tensor> parameters;
    for (const auto& item : model->named_parameters()) {
      if (std::find(held.held.begin(), held.held.end(), item.key()) != held.held.end()) parameters.push_back(item.value());
    }
    if (zero_buckets) {
      optimizer = stage_adamw(model, f.optimizer_settings(), std::move(held), zero_buckets.get());
      sync = std::move(zero_buckets);
    } else {
      if (dp_size > 1) {  // a stage of the only replica has nothing to average with
        sync = dp::make_gradient_synchronizer(flags.grad_sync, ctx, flags.bucket_cap_mb, flags.allreduce);
        sync->attach(parameters);
      }
      optimizer = stage_adamw(model, f.optimizer_settings(), std::move(held));
    }
  } else if (zero_buckets) {
    optimizer = sharded_adamw(model, f.optimizer_settings(), *zero_buckets);
    sync = std::move(zero_buckets);
  } else if (flags.zero_stage == 3) {
    // ZeRO-3: the parameters too are sharded, in units gathered around their forward and backward
    // (zero3_step.h); the units are the step's synchronizer.
    Zero3Parts parts = make_zero3(model, ctx, f.optimizer_settings(), flags.zero_prefetch);
    forward_backward = std::move(parts.forward_backward);
    optimizer = std::move(parts.optimizer);
    sync = std::move(parts.units);
  } else {
    sync = dp::make_gradient_synchronizer(flags.grad_sync, ctx, flags.bucket_cap_mb, flags.allreduce);
    sync->attach(*model);
    optimizer = replicated_adamw(model, f.optimizer_settings());
  }
  if (sync && flags.grad_reduce_dtype == "bf16") sync->set_reduce_dtype(at::kBFloat16);
  if (flags.zero_stage >= 1 && rank == 0) {
    int64_t replicated = 0;
    for (const auto& p : model->parameters()) replicated += 2 * p.numel() * static_cast<int64_t>(p.element_size());
    std::cerr << "run_data_parallel: --zero_stage " << flags.zero_stage << " keeps " << optimizer->state_bytes()
              << " bytes of AdamW state on rank 0 (replicated: " << replicated << " on every rank)"
              << (flags.zero_stage == 2   ? ", and 1/" + std::to_string(ctx.world_size) + " of the gradients"
                  : flags.zero_stage == 3 ? ", and 1/" + std::to_string(ctx.world_size) + " of the gradients and of the parameters"
                                          : std::string())
              << std::endl;
  }
  std::unique_ptr<Tracer> tracer = f.trace.empty() ? nullptr : std::make_unique<Tracer>();
  const std::string track = "rank " + std::to_string(rank);
  TrainStepSettings settings;
  settings.precision = model::parse_precision(f.precision);
  settings.tracer = tracer.get();
  settings.trace_track = track;
  if (C > 1) forward_backward = context_parallel(std::move(forward_backward), C, cp_rank);
  std::unique_ptr<TrainStep> step = std::make_unique<GPT2TrainStep>(model, std::move(forward_backward),
                                                                    std::move(optimizer), sync.get(), settings);
  // Dropout differs per data-parallel rank, as it would in PyTorch's DDP with one seed per
  // process; the ranks of one tensor-parallel group share the seed, so that they draw the same
  // masks on the activations they all hold (Megatron does the same for its replicated regions;
  // attention dropout on each rank's own heads draws from a stream of its own, parallel_rng.h).
  // The ranks of a context group hold different positions: each draws its own masks.
  torch::manual_seed(f.seed + static_cast<uint64_t>(dp_rank * C + cp_rank));

  if (rank == 0) {
    std::cerr << "run_data_parallel: world_size=" << env.world_size << " backend=" << ctx.backend
              << " device=" << device.str() << " threads_per_rank=" << threads << " model="
              << (f.model.path.empty() ? f.model.preset : f.model.path) << " ("
              << model->unsplit_parameter_count() << " parameters"
              << (T > 1 && P == 1 ? ", " + std::to_string(model::count_parameters(*model)) + " on each rank"
                  : P > 1         ? ", " + std::to_string(model::count_parameters(*model)) + " held on rank 0"
                                  : std::string())
              << ") vocab=" << tokenizer.vocab_size()
              << " batch_size=" << f.batch_size << " (per rank " << device_batch << ")"
              << " grad_sync=" << flags.grad_sync << " allreduce=" << dp::to_string(flags.allreduce)
              << " reshuffle_each_epoch=" << (flags.reshuffle_each_epoch ? "true" : "false")
              << " precision=" << f.precision << " grad_reduce_dtype=" << flags.grad_reduce_dtype
              << " zero_stage=" << flags.zero_stage
              << (flags.debug_sync ? " debug_sync=true" : "")
              << (f.gradient_accumulation_steps > 1
                      ? " gradient_accumulation_steps=" + std::to_string(f.gradient_accumulation_steps)
                      : "");
    if (T > 1) {
      std::cerr << " tensor_parallel_size=" << T << " data_parallel_size=" << dp_size;
    }
    if (C > 1) {
      std::cerr << " context_parallel_size=" << C << (T > 1 ? "" : " data_parallel_size=" + std::to_string(dp_size))
                << " sequence_length="
                << context_parallel_length(f.model_max_length, C) << " (" << context_parallel_length(f.model_max_length, C) / C
                << " positions per rank)";
    }
    if (pipeline_stages) {
      std::cerr << " pipeline_parallel_size=" << P << " data_parallel_size=" << dp_size
                << " pipeline_schedule=" << flags.pipe.schedule << " n_chunk=" << flags.pipe.n_chunk
                << " virtual_stages=" << flags.pipe.virtual_stages << " stages=" << pipeline_stages->stages()
                << " balance=" << pipeline_stages->balance_text()
                << " activation_checkpointing=" << flags.pipe.activation_checkpointing;
    }
    std::cerr << std::endl << layout.coordinates_table() << std::flush;
    try {
      const int ranks_here = std::max(1, std::atoi(env_or("LOCAL_WORLD_SIZE", std::to_string(env.world_size)).c_str()));
      const std::vector<Device> here = device.is_cuda() ? std::vector<Device>{device} : std::vector<Device>(ranks_here, device);
      std::cerr << "run_data_parallel: " << memory_plan_line(plan_memory(memory_plan_input(flags, config)), available_memory(here))
                << std::endl;
    } catch (const std::exception& e) {
      std::cerr << "run_data_parallel: memory plan: not made: " << e.what() << std::endl;
    }
  }

  const int64_t max_length = f.model_max_length;
  data::CollateFn collate = [&tokenizer, max_length](const std::vector<data::TranslationExample>& ex) {
    return data::collate(ex, tokenizer, max_length);
  };
  dp::ShardedLoader train_shards(dp_rank, dp_size, corpus.train, f.batch_size, collate,
                                dp::kDefaultPartitionSeed, flags.reshuffle_each_epoch);
  // Validation in batches of the global --batch_size, as the original's validation loader; with
  // C > 1 each context rank evaluates its shard of them (the model sums the loss over the group).
  data::CollateFn validation_collate = collate;
  if (C > 1) {
    validation_collate = [collate, C, cp_rank](const std::vector<data::TranslationExample>& ex) {
      return context_shard(collate(ex), C, cp_rank);
    };
  }
  data::BatchLoader validation_loader(corpus.validation, validation_collate, {f.batch_size, false, 0, false, 2});

  if (flags.pytest) {
    // One batch (or --gradient_accumulation_steps of them): forward, backward, averaged
    // gradients, written before any optimizer step.
    const std::string path = flags.grad_dir + "/model" + std::to_string(rank) + "_gradients.pth";
    write_gradients_of_one_step(*step, train_shards.set_epoch(0), path, f.gradient_accumulation_steps);
    std::cout << "Rank " << rank << ": wrote " << path << std::endl;
    dp::barrier(world);
    report_debug_sync(world);
    return 0;
  }

  TrainingOptions training =
      training_options(f, "run_data_parallel", ReportStyle::kDataParallel);
  training.rank = rank;
  training.world_size = env.world_size;
  training.tensor_parallel_size = T;
  training.data_parallel_size = dp_size;
  // One report per model replica: its tensor rank 0 prints the lines, as its data-parallel rank.
  training.reports = layout.reports(rank);
  training.report_rank = dp_rank;
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
  TrainingData data;
  data.train = [&train_shards](int64_t epoch) -> data::BatchLoader& { return train_shards.set_epoch(epoch); };
  data.validation = &validation_loader;
  data.test = &corpus.test;
  data.tokenizer = &tokenizer;
  run_training(*step, data, training, &world);
  if (const auto* units = dynamic_cast<const dp::ShardedUnits*>(sync.get()); units != nullptr && rank == 0) {
    int64_t largest = 0;
    for (size_t u = 0; u < units->size(); ++u) largest = std::max(largest, units->full_bytes(u));
    std::cerr << "run_data_parallel: --zero_stage 3 held at most " << units->peak_bytes()
              << " bytes of gathered parameters at once while training on rank 0 (largest unit " << largest
              << " bytes, --zero_prefetch " << flags.zero_prefetch << ")" << std::endl;
  }
  if (rank == 0 && sync && sync->finalized_steps() > 0) {
    std::cerr << "run_data_parallel: gradient sync put " << sync->communicated_bytes() << " bytes into all-reduces in "
              << sync->finalized_steps() << " optimizer steps ("
              << sync->communicated_bytes() / sync->finalized_steps() << " per step) on rank 0" << std::endl;
  }

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
  report_debug_sync(world);
  return 0;
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
  const dp::DistContext world = dp::init_process_group(options);
  try {
    return train_this_rank(flags, layout, env, device, threads, options, world);
  } catch (const AgreedStop&) {
    throw;  // every rank says the same
  } catch (const std::exception& e) {
    // A peer that finds this rank gone reads why in the store; this rank, finding a peer gone,
    // names it rather than repeating the transport's words.
    record_stop(e.what(), world);
    throw std::runtime_error(explain_stop(e.what(), world));
  }
}

}  // namespace harness::train
