// run_pipeline: GPT-2 translation training on one device, in model parallel, or as a pipeline
// (GPipe, 1F1B or interleaved 1F1B) over several devices (GPUs, or CPU lanes cpu:0, cpu:1, ...). SPEC §6, §7.
#include <iostream>

#include "common.h"
#include "pipeline_flags.h"
#include "harness/host_memory.h"
#include "harness/train/plan/memory_plan.h"

namespace harness::apps {
namespace {

struct PipelineFlags {
  train::PipelineConfig config;
  std::string export_dataset;
};

PipelineFlags parse(int argc, char** argv) {
  const std::string what = "Train GPT-2 (German->English) on one device, in model parallel, or as a pipeline of devices.";
  cxxopts::Options options("run_pipeline", what);
  add_common_options(options, /*default_batch_size=*/32, /*default_epochs=*/2);
  options.add_options()
      ("model_parallel_mode", "model_parallel | pipeline_parallel (default: one device)", cxxopts::value<std::string>()->default_value(""), "MODE")
      ("shuffle", "reshuffle the training pairs every epoch from --seed")
      ("memory_plan", "print each device's memory plan for this mode and exit");
  add_pipeline_options(options, "in pipeline_parallel mode");
  cxxopts::ParseResult result = parse_or_exit(options, what, argc, argv);
  PipelineFlags flags;
  try {
    const CommonFlags common = read_common(result);
    flags.config.run = common;
    flags.export_dataset = common.export_dataset;
    train::PipelineConfig& c = flags.config;
    c.mode = train::parse_model_parallel_mode(result["model_parallel_mode"].as<std::string>());
    c.shuffle = result.count("shuffle") > 0;
    c.plan.pipeline = read_pipeline_flags(result);
    c.run.memory_plan = result.count("memory_plan") > 0;
    if (c.mode == train::ModelParallelMode::kPipelineParallel &&
        (c.plan.pipeline.n_chunk <= 0 || c.plan.pipeline.n_chunk > c.run.batch_size)) {
      throw std::invalid_argument("--n_chunk " + std::to_string(c.plan.pipeline.n_chunk) +
                                  " must be between 1 and --batch_size " +
                                  std::to_string(c.run.batch_size));
    }
  } catch (const std::exception& e) {
    std::cerr << "run_pipeline: " << e.what() << std::endl;
    std::exit(2);
  }
  return flags;
}

}  // namespace
}  // namespace harness::apps

int main(int argc, char** argv) {
  harness::keep_freed_host_memory();  // reuse, not re-fault, the large tensors of each step
  const harness::apps::PipelineFlags flags = harness::apps::parse(argc, argv);
  try {
    if (!flags.export_dataset.empty()) {
      const harness::train::RunConfig& run = flags.config.run;
      harness::data::export_jsonl(harness::train::load_corpus(run.dataset, run.sizes, run.seed, run.sizes_given),
                                  flags.export_dataset);
      std::cout << "wrote the corpus to " << flags.export_dataset << std::endl;
      return 0;
    }
    if (flags.config.run.memory_plan) return harness::train::print_memory_plan(flags.config);
    return harness::train::run_pipeline(flags.config);
  } catch (const std::exception& e) {
    std::cerr << "run_pipeline: error: " << e.what() << std::endl;
    return 1;
  }
}
