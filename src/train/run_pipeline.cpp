// run_pipeline's work (see run_pipeline.h): one device, model parallel, or a GPipe pipeline over
// devices (GPUs or CPU lanes), trained by the driver.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <iostream>
#include <memory>

#include "harness/model/safetensors.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/trace.h"
#include "harness/train/plan/memory_plan.h"
#include "harness/train/step/build_step.h"
#include "harness/train/run_pipeline.h"

namespace harness::train {

ModelParallelMode parse_model_parallel_mode(const std::string& text) {
  if (text.empty()) return ModelParallelMode::kSingleDevice;
  if (text == "model_parallel") return ModelParallelMode::kModelParallel;
  if (text == "pipeline_parallel") return ModelParallelMode::kPipelineParallel;
  throw std::invalid_argument("--model_parallel_mode '" + text + "': expected model_parallel or pipeline_parallel");
}

std::string to_string(ModelParallelMode mode) {
  switch (mode) {
    case ModelParallelMode::kSingleDevice: return "single_device";
    case ModelParallelMode::kModelParallel: return "model_parallel";
    case ModelParallelMode::kPipelineParallel: return "pipeline_parallel";
  }
  return "?";
}

namespace {

// run_pipeline's devices (one for a single device: the first listed) and its threads per device.
struct PipelineDevices {
  std::vector<Device> devices;
  int threads = 1;
};

PipelineDevices devices_of_run(const PipelineConfig& pipeline) {
  const RunConfig& f = pipeline.run;
  PipelineDevices out;
  out.devices = f.devices.empty() ? default_devices() : parse_device_list(f.devices);
  if (pipeline.mode == ModelParallelMode::kSingleDevice) out.devices.resize(1);
  out.threads = f.threads_per_device > 0 ? f.threads_per_device
                                         : default_threads_per_device(static_cast<int>(out.devices.size()));
  return out;
}

// The schedule flags the mode runs: model parallel is the pipeline with one micro-batch (GPipe's
// order over the same stages, one virtual stage each).
PipelineScheduleConfig schedule_of_mode(const PipelineConfig& pipeline) {
  PipelineScheduleConfig flags = pipeline.plan.pipeline;
  if (pipeline.mode != ModelParallelMode::kPipelineParallel) {
    flags.schedule = pipeline::ScheduleKind::kGpipe;
    flags.virtual_stages = 1;
    flags.n_chunk = 1;
  }
  return flags;
}

// The stages' options of the mode on `devices` devices: a pipeline's split balanced by default,
// model parallel's SPEC §4 placement.
PipelineStepOptions stage_options_of_mode(const PipelineConfig& pipeline, int devices, const model::GPT2Config& config) {
  const PipelineScheduleConfig flags = schedule_of_mode(pipeline);
  if (pipeline.mode != ModelParallelMode::kPipelineParallel) return pipeline_step_options(flags, devices);
  return balanced_pipeline_options(flags, devices, /*processes=*/false, config, pipeline.run.batch_size,
                                   pipeline.run.model_max_length);
}

// The memory plan's input (memory_plan.h) for the mode on `devices`: the batch and sequence of
// the flags, and with a mode its stages' options.
MemoryPlanInput plan_input(const PipelineConfig& pipeline, const model::GPT2Config& config,
                           const std::vector<Device>& devices) {
  const RunConfig& f = pipeline.run;
  MemoryPlanInput in;
  in.program = "run_pipeline";
  in.model_name = f.model.path.empty() ? f.model.preset : f.model.path;
  in.config = config;
  in.rows_per_replica = f.batch_size;
  in.tokens = f.model_max_length;
  in.bf16 = f.precision == model::Precision::kBf16;
  in.plan = pipeline.plan;
  for (const Device& d : devices) in.device_names.push_back(d.str());
  if (pipeline.mode == ModelParallelMode::kSingleDevice) {
    in.device_names.resize(1);
    return in;
  }
  const int D = static_cast<int>(devices.size());
  plan_stages(in, D, stage_options_of_mode(pipeline, D, config), pipeline.plan.pipeline.balance.automatic);
  return in;
}

// The step of the mode (build_step.h): the model on one device, or its stages over the devices
// (model parallel is the pipeline with one micro-batch: GPipe's order over the same stages).
// Everything a schedule needs is checked before the model is placed or a batch is read.
BuiltStep pipeline_mode_step(const PipelineConfig& pipeline, const model::GPT2Config& config, const PipelineDevices& at,
                             Tracer* tracer) {
  const RunConfig& f = pipeline.run;
  const PipelineScheduleConfig& pipe = pipeline.plan.pipeline;
  const bool pipelined = pipeline.mode == ModelParallelMode::kPipelineParallel;
  if (!pipelined && (pipe.schedule != pipeline::ScheduleKind::kOneFOneB || pipe.virtual_stages != 1)) {
    throw std::invalid_argument("--pipeline_schedule and --virtual_stages apply to --model_parallel_mode "
                                "pipeline_parallel only");
  }
  const bool single = pipeline.mode == ModelParallelMode::kSingleDevice;
  if (single && pipe.balance.given()) throw std::invalid_argument("--balance needs --model_parallel_mode");
  RankContext rank;  // one process, no process group
  rank.plan = pipeline.plan;
  rank.device = at.devices.front();
  StepComposition composition;  // the whole model and its AdamW, or its stages over the devices
  composition.optimizer = f.optimizer_settings();
  if (!single) {
    PipelineStepOptions options = stage_options_of_mode(pipeline, static_cast<int>(at.devices.size()), config);
    options.devices = at.devices;
    options.threads_per_device = at.threads;
    options.seed = f.seed;
    options.tracer = tracer;
    composition.balance_rows = (f.batch_size + options.micro_batches - 1) / options.micro_batches;
    composition.balance_tokens = f.model_max_length;
    composition.stages = std::move(options);
  }
  TrainStepSettings settings;
  settings.precision = f.precision;
  const MakeModel make_model = [&](std::shared_ptr<model::TensorParallelGroup>) {
    model::GPT2LMHeadModel model = build_model(f.model, config, f.seed);
    if (single) model->to(at.devices.front().torch_device());  // the stages place their own blocks
    return model;
  };
  return build_step(rank, make_model, composition, settings);
}

// The run's lines on stderr: what trains where, the schedule of the stages, the memory plan.
void print_pipeline_run(const PipelineConfig& pipeline, const PipelineDevices& at, const model::GPT2Config& config,
                        int64_t parameters, const data::Tokenizer& tokenizer,
                        const data::TranslationCorpus& corpus, const PipelineForwardBackward* stages,
                        const std::string& memory_line) {
  const RunConfig& f = pipeline.run;
  const PipelineScheduleConfig& pipe = pipeline.plan.pipeline;
  const bool pipelined = pipeline.mode == ModelParallelMode::kPipelineParallel;
  std::cerr << "run_pipeline: mode=" << to_string(pipeline.mode) << " devices=";
  for (size_t i = 0; i < at.devices.size(); ++i) std::cerr << (i ? "," : "") << at.devices[i].str();
  std::cerr << " threads_per_device=" << at.threads << " model="
            << (f.model.path.empty() ? f.model.preset : f.model.path) << " (" << config.n_layer
            << " layers, n_embd " << config.n_embd << ", " << parameters
            << " parameters) vocab=" << tokenizer.vocab_size() << " batch_size=" << f.batch_size
            << " n_chunk=" << pipe.n_chunk << " precision=" << model::to_string(f.precision)
            << (f.gradient_accumulation_steps > 1
                    ? " gradient_accumulation_steps=" + std::to_string(f.gradient_accumulation_steps)
                    : "")
            << " train/validation/test=" << corpus.train.size() << "/" << corpus.validation.size() << "/"
            << corpus.test.size() << std::endl;
  if (stages) {
    std::cerr << "run_pipeline: schedule=" << (pipelined ? pipeline::to_string(pipe.schedule) : "gpipe")
              << " micro_batches=" << (pipelined ? pipe.n_chunk : 1)
              << " virtual_stages=" << (pipelined ? pipeline::chunks_per_device(pipe.schedule, pipe.virtual_stages) : 1)
              << " stages=" << stages->stages()
              << " balance=" << stages->balance_text()
              << pipeline::balance_origin(pipe.balance, pipelined)
              << " activation_checkpointing=" << pipeline::to_string(pipe.activation_checkpointing) << std::endl;
  }
  std::cerr << "run_pipeline: " << memory_line << std::endl;
}

TrainingOptions pipeline_training_options(const PipelineConfig& pipeline, const PipelineDevices& at,
                                          Tracer* tracer) {
  const RunConfig& f = pipeline.run;
  TrainingOptions options = training_options(f, "run_pipeline", ReportStyle::kPipeline);
  options.plan = pipeline.plan;  // one process
  for (const Device& device : at.devices) {
    if (pipeline.mode != ModelParallelMode::kSingleDevice) options.pipeline_devices.push_back(device.str());
    options.devices.push_back(device.torch_device());
  }
  options.data_order = pipeline.shuffle
                           ? "all training pairs, shuffled each epoch from --seed " + std::to_string(f.seed)
                           : "all training pairs in order";
  options.save_dir = f.workdir;
  options.tokenizer_path = f.workdir + "/tokenizer.model";
  options.tracer = tracer;
  return options;
}

}  // namespace

int print_memory_plan(const PipelineConfig& pipeline) {
  const std::vector<Device> devices = devices_of_run(pipeline).devices;
  const MemoryPlan plan = plan_memory(plan_input(pipeline, resolve_config(pipeline.run.model), devices));
  std::cout << format_memory_plan(plan, available_memory(devices, false, "device")) << std::flush;
  return 0;
}

int run_pipeline(const PipelineConfig& pipeline) {
  const RunConfig& f = pipeline.run;
  check_writable_folder(f.workdir, "--workdir");
  data::TranslationCorpus corpus = load_corpus(f.dataset, f.sizes, f.seed, f.sizes_given);
  const PipelineDevices at = devices_of_run(pipeline);
  at::set_num_threads(at.threads);  // the main thread works for the first device

  model::GPT2Config config = resolve_config(f.model);
  data::Tokenizer tokenizer = prepare_tokenizer(f.model, config, corpus.train, f.workdir + "/tokenizer.model");
  if (f.fit_vocab) fit_vocabulary(config, f.model, tokenizer);
  config.save_json_file(f.workdir + "/config.json");  // as the original, at start
  // Each device's model state against the memory it has, before the model is built.
  const MemoryPlan memory = plan_memory(plan_input(pipeline, config, at.devices));
  const AvailableMemory available = available_memory(at.devices, false, "device");
  check_model_state_fits(memory, available, [](int) {
    return std::string("run_pipeline trains one replica, and ZeRO shards over data-parallel replicas "
                       "(run_data_parallel --zero_stage)");
  });
  std::unique_ptr<Tracer> tracer = f.trace.empty() ? nullptr : std::make_unique<Tracer>();
  BuiltStep built = pipeline_mode_step(pipeline, config, at, tracer.get());
  print_pipeline_run(pipeline, at, config, model::count_parameters(*built.model), tokenizer, corpus, built.stages,
                     memory_plan_line(memory, available));

  const int64_t max_length = f.model_max_length;
  data::CollateFn collate = [&tokenizer, max_length](const std::vector<data::TranslationExample>& ex) {
    return data::collate(ex, tokenizer, max_length);
  };
  data::BatchLoader train_loader(corpus.train, collate, {f.batch_size, pipeline.shuffle, f.seed, false, 2});
  data::BatchLoader validation_loader(corpus.validation, collate, {f.batch_size, false, 0, false, 2});
  TrainingData data;
  data.train = [&train_loader](int64_t) -> data::BatchLoader& { return train_loader; };
  data.validation = &validation_loader;
  data.test = &corpus.test;
  data.tokenizer = &tokenizer;
  run_training(built.step(), data, pipeline_training_options(pipeline, at, tracer.get()));

  if (tracer) tracer->write_chrome_json(f.trace);
  std::cerr << "run_pipeline: model, tokenizer and results are in " << f.workdir
            << (tracer ? ", trace in " + f.trace : std::string()) << std::endl;
  return 0;
}

}  // namespace harness::train
