// run_pipeline: GPT-2 translation training on one device, in model parallel, or as a GPipe
// pipeline over several devices (GPUs, or CPU lanes cpu:0, cpu:1, ...). SPEC §6, §7.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <memory>

#include "common.h"
#include "harness/model/safetensors.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/trace.h"

namespace harness::apps {
namespace {

struct PipelineFlags {
  CommonFlags common;
  std::string mode;  // "", "model_parallel", "pipeline_parallel"
  int64_t n_chunk = 4;
};

PipelineFlags parse(int argc, char** argv) {
  cxxopts::Options options("run_pipeline",
                           "Train GPT-2 (German->English) on one device, model parallel, or pipelined");
  add_common_options(options, /*default_batch_size=*/32, /*default_epochs=*/2);
  options.add_options()
      ("model_parallel_mode", "model_parallel | pipeline_parallel (absent: one device)", cxxopts::value<std::string>()->default_value(""))
      ("n_chunk", "micro-batches per batch in pipeline_parallel mode", cxxopts::value<int64_t>()->default_value("4"));
  cxxopts::ParseResult result = parse_or_exit(options, argc, argv);
  PipelineFlags flags;
  try {
    flags.common = read_common(result);
    flags.mode = result["model_parallel_mode"].as<std::string>();
    flags.n_chunk = result["n_chunk"].as<int64_t>();
    if (!flags.mode.empty() && flags.mode != "model_parallel" && flags.mode != "pipeline_parallel") {
      throw std::invalid_argument("--model_parallel_mode '" + flags.mode +
                                  "': expected model_parallel or pipeline_parallel");
    }
    if (flags.mode == "pipeline_parallel" &&
        (flags.n_chunk <= 0 || flags.n_chunk > flags.common.batch_size)) {
      throw std::invalid_argument("--n_chunk " + std::to_string(flags.n_chunk) +
                                  " must be between 1 and --batch_size " +
                                  std::to_string(flags.common.batch_size));
    }
  } catch (const std::exception& e) {
    std::cerr << "run_pipeline: " << e.what() << std::endl;
    std::exit(2);
  }
  return flags;
}

int run(const PipelineFlags& flags) {
  const CommonFlags& f = flags.common;
  train::make_directories(f.workdir);
  data::TranslationCorpus corpus = train::load_corpus(f.dataset, f.sizes, f.seed);
  if (!f.export_dataset.empty()) {
    data::export_jsonl(corpus, f.export_dataset);
    std::cout << "wrote the corpus to " << f.export_dataset << std::endl;
    return 0;
  }

  std::vector<Device> devices = f.devices.empty() ? default_devices() : parse_device_list(f.devices);
  if (flags.mode.empty()) devices.resize(1);  // one device: the first listed
  const int threads = f.threads_per_device > 0
                          ? f.threads_per_device
                          : default_threads_per_device(static_cast<int>(devices.size()));
  at::set_num_threads(threads);  // the main thread works for the first device

  model::GPT2Config config = train::resolve_config(f.model);
  data::Tokenizer tokenizer =
      train::prepare_tokenizer(f.model, config, corpus.train, f.workdir + "/tokenizer.model");
  if (f.fit_vocab) train::fit_vocabulary(config, f.model, tokenizer);
  model::GPT2LMHeadModel model = train::build_model(f.model, config, f.seed);

  std::unique_ptr<Tracer> tracer = f.trace.empty() ? nullptr : std::make_unique<Tracer>();
  std::shared_ptr<pipeline::Pipe> pipe;
  const c10::Device first = devices.front().torch_device();
  if (flags.mode.empty()) {
    model->to(first);
  } else {
    const int64_t split_size = flags.mode == "pipeline_parallel"
                                   ? (f.batch_size + flags.n_chunk - 1) / flags.n_chunk
                                   : f.batch_size;
    pipeline::PipeOptions options;
    options.threads_per_device = threads;
    options.tracer = tracer.get();
    pipe = pipeline::enable_pipeline(model, devices, split_size, options);
  }

  std::cerr << "run_pipeline: mode=" << (flags.mode.empty() ? "single_device" : flags.mode)
            << " devices=";
  for (size_t i = 0; i < devices.size(); ++i) std::cerr << (i ? "," : "") << devices[i].str();
  std::cerr << " threads_per_device=" << threads << " model="
            << (f.model.path.empty() ? f.model.preset : f.model.path) << " (" << config.n_layer
            << " layers, n_embd " << config.n_embd << ", "
            << model::count_parameters(*model) << " parameters) vocab=" << tokenizer.vocab_size()
            << " batch_size=" << f.batch_size << " n_chunk=" << flags.n_chunk
            << " train/validation/test=" << corpus.train.size() << "/" << corpus.validation.size()
            << "/" << corpus.test.size() << std::endl;

  const int64_t max_length = f.model_max_length;
  data::CollateFn collate = [&tokenizer, max_length](const std::vector<data::TranslationExample>& ex) {
    return data::collate(ex, tokenizer, max_length);
  };
  data::BatchLoader train_loader(corpus.train, collate,
                                 {f.batch_size, /*shuffle=*/true, f.seed, false, 2});
  data::BatchLoader validation_loader(corpus.validation, collate,
                                      {f.batch_size, false, 0, false, 2});

  train::GPT2TrainStep step(model, f.learning_rate);
  train::TrainingOptions options =
      training_options(f, "run_pipeline", train::ReportStyle::kPipeline);
  for (const Device& device : devices) {
    if (!flags.mode.empty()) options.pipeline_devices.push_back(device.str());
    options.devices.push_back(device.torch_device());
  }
  options.data_order = "all training pairs, shuffled each epoch from --seed " + std::to_string(f.seed);
  options.save_dir = f.workdir;
  options.tokenizer_path = f.workdir + "/tokenizer.model";
  options.tracer = tracer.get();
  train::TrainingData data;
  data.train = [&train_loader](int64_t) -> data::BatchLoader& { return train_loader; };
  data.validation = &validation_loader;
  data.test = &corpus.test;
  data.tokenizer = &tokenizer;
  train::run_training(step, data, options);

  if (tracer) tracer->write_chrome_json(f.trace);
  std::cerr << "run_pipeline: model, tokenizer and results are in " << f.workdir
            << (tracer ? ", trace in " + f.trace : std::string()) << std::endl;
  return 0;
}

}  // namespace
}  // namespace harness::apps

int main(int argc, char** argv) {
  const harness::apps::PipelineFlags flags = harness::apps::parse(argc, argv);
  try {
    return harness::apps::run(flags);
  } catch (const std::exception& e) {
    std::cerr << "run_pipeline: error: " << e.what() << std::endl;
    return 1;
  }
}
