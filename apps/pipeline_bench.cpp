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
#include "harness/train/checkpoint_store.h"
#include "harness/train/pipeline_train_step.h"
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
    const std::vector<Device> devices = parse_device_list(r["devices"].as<std::string>());
    const int threads = r["threads_per_device"].as<int>();
    at::set_num_threads(threads);
    std::vector<Configuration> configurations;
    {
      std::stringstream in(r["configs"].as<std::string>());
      for (std::string item; std::getline(in, item, ',');) configurations.push_back(parse_configuration(item));
    }
    train::ModelSource source;
    source.preset = r["model"].as<std::string>();
    model::GPT2Config config = train::resolve_config(source);
    if (r["vocab_size"].as<int64_t>() > 0) config.vocab_size = r["vocab_size"].as<int64_t>();
    const int64_t B = r["batch_size"].as<int64_t>(), T = r["tokens"].as<int64_t>();
    const int steps = r["steps"].as<int>(), warmup = r["warmup"].as<int>();
    const std::string balance_flag = r["balance"].as<std::string>();
    const std::string trace_dir = r["trace_dir"].as<std::string>();
    if (!trace_dir.empty()) train::make_directories(trace_dir);

    torch::manual_seed(5);
    std::vector<data::Batch> batches;
    for (int k = 0; k < 2; ++k) {
      data::Batch b;
      b.input_ids = torch::randint(config.vocab_size, {B, T}, torch::kLong);
      b.labels = torch::randint(config.vocab_size, {B, T}, torch::kLong);
      b.label_token_weights = torch::ones({B, T}, torch::kFloat32);
      batches.push_back(b);
    }

    std::map<int, std::vector<int>> auto_balance;  // stages -> half blocks per stage
    nlohmann::json results = nlohmann::json::array();
    std::map<std::string, double> tokens_per_second;
    for (const Configuration& c : configurations) {
      model::GPT2LMHeadModel model = train::build_model(source, config, 1234);
      train::PipelineStepOptions o;
      o.devices = devices;
      o.schedule = pipeline::parse_schedule_kind(c.schedule);
      o.virtual_stages = c.virtual_stages;
      o.micro_batches = c.micro_batches;
      o.checkpointing = pipeline::parse_activation_checkpointing(c.checkpointing);
      o.threads_per_device = threads;
      o.seed = 1;
      const int stages = static_cast<int>(devices.size()) * c.virtual_stages;
      const pipeline::BalanceSpec spec = pipeline::parse_balance(balance_flag);
      if (spec.automatic) {
        // Timed once per number of stages (on micro-batches of a quarter batch), so that every
        // configuration with that many stages compares on the same balance.
        auto& halves = auto_balance[stages];
        if (halves.empty()) {
          halves = pipeline::balance_gpt2_by_time(model, devices.front(), stages, std::max<int64_t>(1, B / 4), T);
          std::cerr << "[pipeline_bench] --balance auto over " << stages << " stages: "
                    << halves.size() << " stages of half blocks";
          for (int h : halves) std::cerr << " " << h;
          std::cerr << std::endl;
        }
        o.balance_halves = halves;
      } else if (static_cast<int>(spec.halves_per_stage.size()) == stages) {
        o.balance_halves = spec.halves_per_stage;  // only the configurations with as many stages
      }
      Tracer tracer;
      o.tracer = &tracer;
      train::PipelineTrainStep step(model, 1e-4, o);
      step.set_training(true);
      std::vector<double> times;
      int64_t traced_from = 0;
      for (int k = 0; k < warmup + steps; ++k) {
        if (k == warmup + steps - 1) traced_from = tracer.now_us();
        const auto start = std::chrono::steady_clock::now();
        {
          TraceScope scope(&tracer, "step", "main", {{"step", static_cast<int64_t>(k)}});
          step.step(batches[k % 2]);
        }
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (k >= warmup) times.push_back(t);
      }
      // One more untimed step for the memory figures (peaks of one step).
      pipeline::reset_activation_peaks();
      const std::vector<int64_t> before = pipeline::activation_live_bytes(static_cast<int>(devices.size()));
      step.step(batches[0]);
      const std::vector<int64_t> peak = pipeline::activation_peak_bytes(static_cast<int>(devices.size()));
      std::vector<int64_t> peak_allocated;
      for (size_t d = 0; d < devices.size(); ++d) peak_allocated.push_back(peak[d] - before[d]);
      std::vector<double> sorted = times;
      std::sort(sorted.begin(), sorted.end());
      const double median = sorted[sorted.size() / 2];
      const pipeline::TrainingSchedule& schedule = step.last_schedule();
      const double unit_bubble = pipeline::simulate_unit_time(schedule).bubble;
      const double bubble = measured_bubble(tracer, static_cast<int>(devices.size()), traced_from);
      if (!trace_dir.empty()) tracer.write_chrome_json(trace_dir + "/" + c.name() + ".trace.json");
      nlohmann::json entry = {{"name", c.name()},
                              {"schedule", schedule.name},
                              {"micro_batches", c.micro_batches},
                              {"virtual_stages", c.virtual_stages},
                              {"activation_checkpointing", c.checkpointing},
                              {"balance", step.balance_text()},
                              {"step_seconds", times},
                              {"step_seconds_median", median},
                              {"tokens_per_second", static_cast<double>(B * T) / median},
                              {"bubble_measured", bubble},
                              {"bubble_unit_time", unit_bubble},
                              {"peak_in_flight", step.last_peak_in_flight()},
                              // sampled by the executor as each forward of the memory step returned
                              {"peak_held_activation_bytes", step.last_peak_held_bytes()},
                              // the allocator's peak, a forward's temporaries and recomputation included
                              {"peak_allocated_in_forwards_bytes", peak_allocated},
                              {"traced_step", warmup + steps - 1}};
      tokens_per_second[c.name()] = static_cast<double>(B * T) / median;
      std::cerr << "[pipeline_bench] " << c.name() << ": " << median << " s/step, "
                << static_cast<double>(B * T) / median << " tok/s, bubble " << bubble << " (unit-time "
                << unit_bubble << "), balance " << step.balance_text() << std::endl;
      results.push_back(entry);
    }
    nlohmann::json out = {{"model", source.preset},
                          {"n_layer", config.n_layer},
                          {"n_embd", config.n_embd},
                          {"vocab_size", config.vocab_size},
                          {"batch_size", B},
                          {"tokens", T},
                          {"devices", r["devices"].as<std::string>()},
                          {"threads_per_device", threads},
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
