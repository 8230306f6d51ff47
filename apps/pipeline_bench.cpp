// pipeline_bench: GPT-2 training steps through the schedule executor on synthetic batches, for a
// list of configurations (schedule, micro-batches, virtual stages, activation checkpointing), all
// in one process so that their ratios share the machine's state. For each it reports the median
// step time and tokens/s, the bubble measured from a traced step against the schedule's unit-time
// bubble, and each device's peak held activation bytes (a counting CPU allocator). Writes --out
// (JSON) for scripts/run_benchmarks.py, and a Chrome trace per configuration to --trace_dir.
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cxxopts.hpp>
#include <iostream>
#include <sstream>

#include "help.h"
#include "harness/device.h"
#include "harness/trace.h"
#include "harness/pipeline/activation_meter.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/train/checkpoint/checkpoint_store.h"
#include "harness/train/step/build_step.h"
#include "harness/train/setup.h"

namespace {

using namespace harness;

struct Configuration {
  std::string schedule;  // gpipe | 1f1b | interleaved
  int micro_batches = 1;
  int virtual_stages = 1;
  std::string checkpointing = "never";
  std::string name() const {
    std::string n = micro_batches == 1 && schedule == "gpipe" && virtual_stages == 1
                        ? "model_parallel"
                        : schedule + "_m" + std::to_string(micro_batches);
    if (virtual_stages > 1) n += "_v" + std::to_string(virtual_stages);
    if (checkpointing != "never") n += "_ckpt-" + checkpointing;
    return n;
  }
};

// "1f1b/4", "interleaved/8/2", "gpipe/4/1/always"
Configuration parse_configuration(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, '/');) parts.push_back(part);
  if (parts.size() < 2 || parts.size() > 4) {
    throw std::invalid_argument("--configs item '" + text + "': expected SCHEDULE/M[/V[/CHECKPOINTING]]");
  }
  Configuration c;
  c.schedule = parts[0];
  c.micro_batches = std::stoi(parts[1]);
  if (parts.size() > 2) c.virtual_stages = std::stoi(parts[2]);
  if (parts.size() > 3) c.checkpointing = parts[3];
  (void)pipeline::parse_activation_checkpointing(c.checkpointing);
  return c;
}

// 1 - busy / (devices x window) over the slices of the step that ends last.
double measured_bubble(const Tracer& tracer, int devices, int64_t since_us) {
  int64_t lo = INT64_MAX, hi = 0;
  std::map<std::string, int64_t> busy;
  for (const auto& s : tracer.slices()) {
    if (s.start_us < since_us || (s.name != "forward" && s.name != "backward")) continue;
    lo = std::min(lo, s.start_us);
    hi = std::max(hi, s.end_us);
    busy[s.track] += s.end_us - s.start_us;
  }
  if (hi <= lo) return 0.0;
  int64_t total = 0;
  for (const auto& [track, us] : busy) total += us;
  return 1.0 - static_cast<double>(total) / (static_cast<double>(devices) * static_cast<double>(hi - lo));
}

// What every configuration shares: the model, the devices, the batches and the step counts.
struct Bench {
  train::ModelSource source;
  model::GPT2Config config;
  std::vector<Device> devices;
  int threads = 1;
  int64_t rows = 0, tokens = 0;
  int steps = 0, warmup = 0;
  pipeline::BalanceSpec balance;
  std::string trace_dir;
  std::vector<data::Batch> batches;               // two, taken in turn
  std::map<int, std::vector<int>> auto_balance;  // stages -> half blocks per stage (timed once)
};

// The balance configuration `c` runs with: --balance auto timed once per number of stages (on
// micro-batches of a quarter batch), so that every configuration with that many stages compares
// on the same balance; an explicit list only for the configurations with as many stages.
std::vector<int> balance_for(Bench& bench, model::GPT2LMHeadModel& model, int stages) {
  if (bench.balance.automatic) {
    auto& halves = bench.auto_balance[stages];
    if (halves.empty()) {
      halves = pipeline::balance_gpt2_by_time(model, bench.devices.front(), stages,
                                              std::max<int64_t>(1, bench.rows / 4), bench.tokens);
      std::cerr << "[pipeline_bench] --balance auto over " << stages << " stages: " << halves.size()
                << " stages of half blocks";
      for (int h : halves) std::cerr << " " << h;
      std::cerr << std::endl;
    }
    return halves;
  }
  if (static_cast<int>(bench.balance.halves_per_stage.size()) == stages) return bench.balance.halves_per_stage;
  return {};
}

// One configuration's figures: the timed steps (the last one traced), then one more step for the
// memory peaks.
nlohmann::json measure(Bench& bench, const Configuration& c) {
  const int D = static_cast<int>(bench.devices.size());
  model::GPT2LMHeadModel model = train::build_model(bench.source, bench.config, 1234);
  train::PipelineStepOptions o;
  o.devices = bench.devices;
  o.schedule = pipeline::parse_schedule_kind(c.schedule);
  o.virtual_stages = c.virtual_stages;
  o.micro_batches = c.micro_batches;
  o.checkpointing = pipeline::parse_activation_checkpointing(c.checkpointing);
  o.threads_per_device = bench.threads;
  o.seed = 1;
  o.balance_halves = balance_for(bench, model, D * c.virtual_stages);
  Tracer tracer;
  o.tracer = &tracer;
  train::RankContext rank;  // one process, its stages over the devices
  rank.device = bench.devices.front();
  train::StepComposition composition;
  composition.optimizer = train::OptimizerSettings(1e-4);
  composition.stages = o;
  train::BuiltStep built = train::build_step(
      rank, [&model](std::shared_ptr<model::TensorParallelGroup>) { return model; }, composition, {});
  train::TrainStep& step = built.step();
  const train::PipelineForwardBackward& stages = *built.stages;
  step.set_training(true);
  std::vector<double> times;
  int64_t traced_from = 0;
  const int last = bench.warmup + bench.steps - 1;
  for (int k = 0; k <= last; ++k) {
    if (k == last) traced_from = tracer.now_us();
    const auto start = std::chrono::steady_clock::now();
    {
      TraceScope scope(&tracer, "step", "main", {{"step", static_cast<int64_t>(k)}});
      step.step(bench.batches[k % 2]);
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (k >= bench.warmup) times.push_back(t);
  }
  pipeline::reset_activation_peaks();
  const std::vector<int64_t> before = pipeline::activation_live_bytes(D);
  step.step(bench.batches[0]);
  const std::vector<int64_t> peak = pipeline::activation_peak_bytes(D);
  std::vector<int64_t> peak_allocated;
  for (int d = 0; d < D; ++d) peak_allocated.push_back(peak[d] - before[d]);
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double tokens_per_second = static_cast<double>(bench.rows * bench.tokens) / median;
  const pipeline::TrainingSchedule& schedule = stages.last_schedule();
  const double unit_bubble = pipeline::simulate_unit_time(schedule).bubble;
  const double bubble = measured_bubble(tracer, D, traced_from);
  if (!bench.trace_dir.empty()) tracer.write_chrome_json(bench.trace_dir + "/" + c.name() + ".trace.json");
  std::cerr << "[pipeline_bench] " << c.name() << ": " << median << " s/step, " << tokens_per_second
            << " tok/s, bubble " << bubble << " (unit-time " << unit_bubble << "), balance " << stages.balance_text()
            << std::endl;
  return {{"name", c.name()},
          {"schedule", schedule.name},
          {"micro_batches", c.micro_batches},
          {"virtual_stages", c.virtual_stages},
          {"activation_checkpointing", c.checkpointing},
          {"balance", stages.balance_text()},
          {"step_seconds", times},
          {"step_seconds_median", median},
          {"tokens_per_second", tokens_per_second},
          {"bubble_measured", bubble},
          {"bubble_unit_time", unit_bubble},
          {"peak_in_flight", stages.last_peak_in_flight()},
          // sampled by the executor as each forward of the memory step returned
          {"peak_held_activation_bytes", stages.last_peak_held_bytes()},
          // the allocator's peak, a forward's temporaries and recomputation included
          {"peak_allocated_in_forwards_bytes", peak_allocated},
          {"traced_step", last}};
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = "GPT-2 pipeline schedules: speed, bubble and activation memory";
  cxxopts::Options options("pipeline_bench", what);
  options.add_options()
      ("model", "GPT-2 preset", cxxopts::value<std::string>()->default_value("gpt2-mini"))
      ("vocab_size", "vocabulary (0: the preset's)", cxxopts::value<int64_t>()->default_value("0"))
      ("batch_size", "rows per step", cxxopts::value<int64_t>()->default_value("96"))
      ("tokens", "tokens per row", cxxopts::value<int64_t>()->default_value("64"))
      ("devices", "devices (CPU lanes or GPUs)", cxxopts::value<std::string>()->default_value("cpu:0,cpu:1"))
      ("threads_per_device", "intra-op threads per device", cxxopts::value<int>()->default_value("1"))
      ("balance", "auto | N,N,... | empty (default runs); for V > 1 the default", cxxopts::value<std::string>()->default_value(""))
      ("steps", "timed steps per configuration", cxxopts::value<int>()->default_value("4"))
      ("warmup", "untimed steps first", cxxopts::value<int>()->default_value("1"))
      ("configs", "SCHEDULE/M[/V[/CHECKPOINTING]] list",
       cxxopts::value<std::string>()->default_value(
           "gpipe/1,gpipe/4,1f1b/4,interleaved/4/2,gpipe/8,1f1b/8,interleaved/8/2,1f1b/4/1/except_last,1f1b/4/1/always"))
      ("trace_dir", "write <dir>/<configuration>.trace.json (one traced step each)", cxxopts::value<std::string>()->default_value(""))
      ("out", "JSON results", cxxopts::value<std::string>()->default_value("pipeline_bench.json"))
      ("h,help", "this help");
  try {
    const cxxopts::ParseResult r = options.parse(argc, argv);
    if (r.count("help")) {
      std::cout << harness::apps::one_line_help(options, what);
      return 0;
    }
    pipeline::install_activation_meter();
    Bench bench;
    bench.devices = parse_device_list(r["devices"].as<std::string>());
    bench.threads = r["threads_per_device"].as<int>();
    at::set_num_threads(bench.threads);
    std::vector<Configuration> configurations;
    {
      std::stringstream in(r["configs"].as<std::string>());
      for (std::string item; std::getline(in, item, ',');) configurations.push_back(parse_configuration(item));
    }
    bench.source.preset = r["model"].as<std::string>();
    bench.config = train::resolve_config(bench.source);
    if (r["vocab_size"].as<int64_t>() > 0) bench.config.vocab_size = r["vocab_size"].as<int64_t>();
    bench.rows = r["batch_size"].as<int64_t>();
    bench.tokens = r["tokens"].as<int64_t>();
    bench.steps = r["steps"].as<int>();
    bench.warmup = r["warmup"].as<int>();
    const std::string balance_flag = r["balance"].as<std::string>();
    bench.balance = pipeline::parse_balance(balance_flag);
    bench.trace_dir = r["trace_dir"].as<std::string>();
    if (!bench.trace_dir.empty()) train::make_directories(bench.trace_dir);

    torch::manual_seed(5);
    const int64_t B = bench.rows, T = bench.tokens;
    for (int k = 0; k < 2; ++k) {
      data::Batch b;
      b.input_ids = torch::randint(bench.config.vocab_size, {B, T}, torch::kLong);
      b.labels = torch::randint(bench.config.vocab_size, {B, T}, torch::kLong);
      b.label_token_weights = torch::ones({B, T}, torch::kFloat32);
      bench.batches.push_back(b);
    }
    nlohmann::json results = nlohmann::json::array();
    for (const Configuration& c : configurations) results.push_back(measure(bench, c));
    nlohmann::json out = {{"model", bench.source.preset},
                          {"n_layer", bench.config.n_layer},
                          {"n_embd", bench.config.n_embd},
                          {"vocab_size", bench.config.vocab_size},
                          {"batch_size", B},
                          {"tokens", T},
                          {"devices", r["devices"].as<std::string>()},
                          {"threads_per_device", bench.threads},
                          {"balance_flag", balance_flag},
                          {"configurations", results}};
    train::write_file_synced(r["out"].as<std::string>(), out.dump(2) + "\n");
    std::cerr << "[pipeline_bench] wrote " << r["out"].as<std::string>() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "pipeline_bench: error: " << e.what() << std::endl;
    return 1;
  }
}
