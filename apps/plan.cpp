// plan: predicts a training step's time and memory for a model, a batch and a machine, without
// running it (train/plan/cost_model.h, docs/planning.md). Given run_data_parallel's layout flags
// it predicts that layout; without them it lists every valid layout of --world_size devices,
// fastest first. --calibrate FILE measures this machine and writes a machine file.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "pipeline_flags.h"
#include "harness/host_memory.h"
#include "harness/train/plan/cost_model.h"

namespace harness::apps {
namespace {

namespace dp = harness::data_parallel;

// The layout flags, named as run_data_parallel's: given any, plan predicts that one layout.
constexpr const char* kLayoutFlags[] = {"tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                                        "sequence_parallel", "zero_stage", "n_chunk", "pipeline_schedule",
                                        "virtual_stages", "activation_checkpointing"};

void add_plan_options(cxxopts::Options& options) {
  options.add_options()
      ("model", "preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-mini, gpt2-tiny", cxxopts::value<std::string>()->default_value("gpt2"), "NAME")
      ("model_path", "Hugging Face folder whose config.json gives the shape (default: none)", cxxopts::value<std::string>()->default_value(""), "DIR")
      ("n_layer", "blocks, instead of the preset's (0: the preset's)", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("n_embd", "hidden size, instead of the preset's (0: the preset's)", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("n_head", "attention heads, instead of the preset's (0: the preset's)", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("vocab_size", "vocabulary, instead of the preset's (0: the preset's)", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("n_positions", "positions, instead of the preset's (0: the preset's)", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("batch_size", "global batch", cxxopts::value<int64_t>()->default_value("32"), "N")
      ("model_max_length", "tokens per example", cxxopts::value<int64_t>()->default_value("128"), "N")
      ("precision", "fp32 | bf16", cxxopts::value<std::string>()->default_value("fp32"), "P")
      ("world_size", "devices in all", cxxopts::value<int>()->default_value("2"), "N")
      ("nproc_per_node", "devices a host (0: the machine file's)", cxxopts::value<int>()->default_value("0"), "N")
      ("machine", "machine file (JSON; machines/*.json, or one --calibrate wrote)", cxxopts::value<std::string>()->default_value(""), "FILE")
      ("calibrate", "measure this machine and write its machine file to FILE, then exit", cxxopts::value<std::string>()->default_value(""), "FILE")
      ("json", "write the predictions as one JSON object instead of a table")
      ("tensor_parallel_size", "T of the one layout to predict", cxxopts::value<int>()->default_value("1"), "T")
      ("pipeline_parallel_size", "P of the one layout to predict", cxxopts::value<int>()->default_value("1"), "P")
      ("context_parallel_size", "C of the one layout to predict", cxxopts::value<int>()->default_value("1"), "C")
      ("sequence_parallel", "with T > 1: LayerNorm and dropout on 1/T of each sequence")
      ("zero_stage", "0 | 1 | 2 | 3 of the one layout to predict", cxxopts::value<int>()->default_value("0"), "S");
  add_pipeline_options(options, "with --pipeline_parallel_size above 1");
}

// The model's shape: the preset or --model_path's config.json, each size flag given in its place.
model::GPT2Config shape_of(const cxxopts::ParseResult& r) {
  const std::string path = r["model_path"].as<std::string>();
  model::GPT2Config config = path.empty() ? model::GPT2Config::preset(r["model"].as<std::string>())
                                          : model::GPT2Config::from_json_file(path + "/config.json");
  for (const auto& [flag, field] : {std::pair<const char*, int64_t*>{"n_layer", &config.n_layer},
                                    {"n_embd", &config.n_embd},
                                    {"n_head", &config.n_head},
                                    {"vocab_size", &config.vocab_size},
                                    {"n_positions", &config.n_positions}}) {
    const int64_t value = r[flag].as<int64_t>();
    if (value < 0) throw std::invalid_argument(std::string("--") + flag + " must be >= 0, got " + std::to_string(value));
    if (value > 0) *field = value;
  }
  config.validate();
  return config;
}

train::PlanQuestion question_of(const cxxopts::ParseResult& r) {
  train::PlanQuestion q;
  q.config = shape_of(r);
  q.model_name = r["model_path"].as<std::string>().empty() ? r["model"].as<std::string>() : r["model_path"].as<std::string>();
  q.batch_size = r["batch_size"].as<int64_t>();
  q.sequence_length = r["model_max_length"].as<int64_t>();
  if (q.batch_size < 1 || q.sequence_length < 1) {
    throw std::invalid_argument("--batch_size and --model_max_length must be positive");
  }
  q.bf16 = model::parse_precision(r["precision"].as<std::string>()) == model::Precision::kBf16;
  q.nproc_per_node = r["nproc_per_node"].as<int>();
  const std::string machine = r["machine"].as<std::string>();
  if (machine.empty()) throw std::invalid_argument("--machine FILE is needed: one of machines/*.json, or one --calibrate wrote");
  q.machine = train::read_machine(machine);
  return q;
}

train::Plan one_layout(const cxxopts::ParseResult& r, int world_size) {
  train::Plan plan;
  plan.world_size = world_size;
  plan.tensor_parallel_size = r["tensor_parallel_size"].as<int>();
  plan.pipeline_parallel_size = r["pipeline_parallel_size"].as<int>();
  plan.context_parallel_size = r["context_parallel_size"].as<int>();
  plan.sequence_parallel = r.count("sequence_parallel") > 0;
  plan.zero.stage = r["zero_stage"].as<int>();
  plan.pipeline = read_pipeline_flags(r);
  return plan;
}

std::string layout_text(const train::Plan& plan) {
  std::ostringstream out;
  out << "D" << plan.data_parallel_size() << " C" << plan.context_parallel_size << " T" << plan.tensor_parallel_size
      << (plan.sequence_parallel ? "+sp" : "") << " P" << plan.pipeline_parallel_size << " zero" << plan.zero.stage;
  if (plan.pipeline_parallel_size > 1) {
    out << " " << pipeline::to_string(plan.pipeline.schedule) << " M" << plan.pipeline.n_chunk
        << (plan.pipeline.activation_checkpointing == pipeline::ActivationCheckpointing::kNever ? "" : " ckpt");
  }
  return out.str();
}

// One row a layout: tokens/s, the step's parts in milliseconds, memory, and whether it fits.
void print_table(const train::PlanQuestion& q, int world_size, const std::vector<train::StepPrediction>& rows) {
  std::cout << "plan: " << q.model_name << " (" << q.config.n_layer << " layers, n_embd " << q.config.n_embd
            << ", n_head " << q.config.n_head << ", vocab " << q.config.vocab_size << "), batch " << q.batch_size
            << " x " << q.sequence_length << " tokens, " << (q.bf16 ? "bf16" : "fp32") << ", " << world_size
            << " devices of " << q.machine.name << "\n";
  std::cout << "  " << std::left << std::setw(34) << "layout" << std::right << std::setw(12) << "tokens/s"
            << std::setw(10) << "step ms" << std::setw(10) << "compute" << std::setw(10) << "comm" << std::setw(10)
            << "bubble" << std::setw(10) << "optim" << std::setw(8) << "mfu" << std::setw(12) << "MiB/dev"
            << "  fits\n";
  for (const train::StepPrediction& p : rows) {
    std::cout << "  " << std::left << std::setw(34) << layout_text(p.plan) << std::right << std::fixed
              << std::setprecision(0) << std::setw(12) << p.tokens_per_second << std::setprecision(2) << std::setw(10)
              << 1e3 * p.step_seconds << std::setw(10) << 1e3 * p.compute_seconds << std::setw(10)
              << 1e3 * p.exposed_comm_seconds << std::setw(10) << 1e3 * p.bubble_seconds << std::setw(10)
              << 1e3 * p.optimizer_seconds << std::setw(8) << p.mfu << std::setprecision(0) << std::setw(12)
              << p.memory_bytes_per_device / 1048576.0 << "  " << (p.fits ? "yes" : "no: " + p.why_not) << "\n"
              << std::defaultfloat;
  }
}

// The median seconds of `run` over a few repetitions after a warm-up.
template <typename F>
double median_seconds(F run, int repetitions = 5) {
  run();
  std::vector<double> times;
  for (int i = 0; i < repetitions; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// --calibrate: this machine's figures, measured on one device of it (a CPU process with
// cores / devices threads): square matmuls in each precision, an element-wise pass, the memory.
// Its links are those of processes on one host (the loopback), which the timed copies stand for.
int calibrate(const std::string& path, int devices) {
  const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, devices));
  at::set_num_threads(threads);
  const int64_t n = 1024;
  const at::Tensor a = torch::randn({n, n}), b = torch::randn({n, n});
  const double fp32 = 2.0 * n * n * n / median_seconds([&] { (void)torch::mm(a, b); });
  const at::Tensor a16 = a.to(torch::kBFloat16), b16 = b.to(torch::kBFloat16);
  const double bf16 = 2.0 * n * n * n / median_seconds([&] { (void)torch::mm(a16, b16); });
  const at::Tensor x = torch::randn({1 << 24}), y = torch::randn({1 << 24});
  at::Tensor z = torch::empty_like(x);
  const double memory = 3.0 * 4.0 * x.numel() / median_seconds([&] { at::add_out(z, x, y); });
  const double copy = 2.0 * 4.0 * x.numel() / median_seconds([&] { z.copy_(x); });
  train::Machine m;
  m.name = "this machine (" + std::to_string(devices) + " CPU devices of " + std::to_string(threads) + " threads)";
  m.devices_per_host = devices;
  m.fp32_flops = fp32, m.bf16_flops = bf16, m.matmul_efficiency = 1.0;
  m.memory_bytes_per_second = memory;
  m.memory_bytes = harness::host_available_memory_bytes() / devices;
  m.inside_host = {copy / 2.0, 50e-6};
  m.between_hosts = {copy / 2.0, 50e-6};
  m.sources = {{"fp32_flops", "timed: torch::mm of 1024 x 1024 fp32, median of 5"},
               {"bf16_flops", "timed: torch::mm of 1024 x 1024 bf16, median of 5"},
               {"matmul_efficiency", "1: the timed rates are what matmuls reach here"},
               {"memory_bytes_per_second", "timed: add_out over 3 x 64 MiB fp32, median of 5"},
               {"memory_bytes", "MemAvailable over the devices"},
               {"inside_host", "timed copy at half its rate (a loopback send copies twice), 50 us a message"},
               {"between_hosts", "one host: the same as inside_host"}};
  std::ofstream(path) << train::machine_to_json(m).dump(2) << "\n";
  std::cout << "plan: wrote " << path << " (" << m.name << ")" << std::endl;
  return 0;
}

}  // namespace
}  // namespace harness::apps

int main(int argc, char** argv) {
  using namespace harness::apps;
  const std::string what = "Predict a training step's time and memory for every layout of a machine, or one.";
  cxxopts::Options options("plan", what);
  add_plan_options(options);
  const cxxopts::ParseResult result = parse_or_exit(options, what, argc, argv);
  try {
    const int world_size = result["world_size"].as<int>();
    if (world_size < 1) throw std::invalid_argument("--world_size must be positive, got " + std::to_string(world_size));
    if (const std::string file = result["calibrate"].as<std::string>(); !file.empty()) {
      return calibrate(file, result["nproc_per_node"].as<int>() > 0 ? result["nproc_per_node"].as<int>() : world_size);
    }
    const harness::train::PlanQuestion question = question_of(result);
    bool one = false;
    for (const char* flag : kLayoutFlags) one = one || result.count(flag) > 0;
    const std::vector<harness::train::StepPrediction> predictions =
        one ? std::vector<harness::train::StepPrediction>{harness::train::predict_step(question, one_layout(result, world_size))}
            : harness::train::rank_layouts(question, world_size);
    if (result.count("json")) {
      std::cout << harness::train::predictions_to_json(question, world_size, predictions).dump(2) << std::endl;
    } else {
      print_table(question, world_size, predictions);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "plan: " << e.what() << std::endl;
    return 2;
  }
}
