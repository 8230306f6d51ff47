// pipeline_schedule: prints a pipeline training schedule for S stages and M micro-batches. GPipe:
// the forward and backward clock tables Pipe executes (harness/pipeline/schedule.h), the Gantt
// chart of one step and its bubble ratio. All schedules (GPipe, 1F1B, interleaved 1F1B with V
// chunks per device, and the zero-bubble ZB-H1 and ZB-V; harness/pipeline/training_schedule.h):
// each device's actions, the unit-time Gantt chart, the bubble and the peak in-flight
// micro-batches per device. The zero-bubble ones, whose backward is split into B and W, are drawn
// on the paper's clock instead (F, B and W one tick each, so a whole backward takes two), next
// to 1F1B on the same clock. ZB-V with --model: the order a run of that GPT-2 takes, made on its
// stages' estimated costs, and its step on those costs beside the paper's order's.
#include <cxxopts.hpp>

#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "help.h"
#include "model_preset.h"
#include "harness/model/gpt2.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/pipeline/schedule.h"
#include "harness/pipeline/training_schedule.h"

namespace {

using namespace harness::pipeline;

struct Config {
  std::string schedule = "gpipe";
  int stages = 4;
  int micro_batches = 6;
  int virtual_stages = 1;
  std::string model;  // zbv: the preset (NAME or NAME:VOCAB) whose estimated costs order it
  int rows = 8;       // per micro-batch, with --model
  int tokens = 128;   // per row, with --model
  std::string balance;  // with --model: half blocks per stage as --balance takes them; "": the default split
};

// Flags are read as text so that a bad number names its flag, which cxxopts' own message does not.
int parse_int_flag(const std::string& flag, const std::string& text) {
  const std::optional<int64_t> value = harness::apps::whole_integer(text);
  if (!value || *value < std::numeric_limits<int>::min() || *value > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("--" + flag + " '" + text + "' is not an integer");
  }
  return static_cast<int>(*value);
}

Config parse_config(const cxxopts::ParseResult& result) {
  if (!result.unmatched().empty()) {
    throw std::invalid_argument("unexpected argument '" + result.unmatched().front() + "'");
  }
  Config config;
  config.schedule = result["schedule"].as<std::string>();
  if (config.schedule != "gpipe" && config.schedule != "1f1b" && config.schedule != "interleaved" &&
      config.schedule != "zb1p" && config.schedule != "zbv") {
    throw std::invalid_argument("--schedule '" + config.schedule +
                                "' is not one of gpipe, 1f1b, interleaved, zb1p, zbv");
  }
  config.stages = parse_int_flag("stages", result["stages"].as<std::string>());
  config.micro_batches = parse_int_flag("micro_batches", result["micro_batches"].as<std::string>());
  const bool interleaved = config.schedule == "interleaved";
  config.virtual_stages =
      result.count("virtual_stages")
          ? parse_int_flag("virtual_stages", result["virtual_stages"].as<std::string>())
          : (interleaved ? 2 : 1);
  if (config.stages < 1) {
    throw std::invalid_argument("--stages " + std::to_string(config.stages) +
                                " must be at least 1");
  }
  if (config.micro_batches < 1) {
    throw std::invalid_argument("--micro_batches " + std::to_string(config.micro_batches) +
                                " must be at least 1");
  }
  if (config.virtual_stages < 1) {
    throw std::invalid_argument("--virtual_stages " + std::to_string(config.virtual_stages) +
                                " must be at least 1");
  }
  if (!interleaved && config.virtual_stages != 1) {
    throw std::invalid_argument("--virtual_stages " + std::to_string(config.virtual_stages) +
                                " needs --schedule interleaved; " + config.schedule +
                                (config.schedule == "zbv" ? " runs its own two chunks per device"
                                                          : " runs one stage per device"));
  }
  config.model = result["model"].as<std::string>();
  config.rows = parse_int_flag("rows", result["rows"].as<std::string>());
  config.tokens = parse_int_flag("tokens", result["tokens"].as<std::string>());
  if (!config.model.empty() && config.schedule != "zbv") {
    throw std::invalid_argument("--model orders --schedule zbv only; " + config.schedule +
                                "'s order does not depend on what its stages cost");
  }
  config.balance = result["balance"].as<std::string>();
  if (!config.balance.empty() && config.model.empty()) {
    throw std::invalid_argument("--balance needs --model: it splits that model's blocks");
  }
  if (config.rows < 1 || config.tokens < 1) {
    throw std::invalid_argument("--rows " + std::to_string(config.rows) + " and --tokens " +
                                std::to_string(config.tokens) + " must be at least 1");
  }
  if (interleaved && config.micro_batches % config.stages != 0) {
    throw std::invalid_argument(
        "--micro_batches " + std::to_string(config.micro_batches) +
        " is not divisible by --stages " + std::to_string(config.stages) +
        ", as the interleaved schedule needs (e.g. --micro_batches " +
        std::to_string((config.micro_batches / config.stages + 1) * config.stages) + ")");
  }
  return config;
}

// Today's GPipe report, unchanged: the clock tables Pipe executes, their Gantt chart and bubble.
void print_gpipe_clock_schedule(int s, int m) {
  const ScheduleTable schedule = schedule_table(m, s);
  std::cout << "GPipe schedule: S=" << s << " stages, M=" << m << " micro-batches, "
            << m + s - 1 << " clock ticks forward and as many backward\n\n";
  std::cout << "Forward clock table (micro-batch run by each stage at each tick, . = idle):\n"
            << format_clock_table(schedule.forward) << "\n";
  std::cout << "Backward clock table:\n" << format_clock_table(schedule.backward) << "\n";
  std::cout << "Gantt chart of one step (F<i> forward, B<i> backward of micro-batch i, . = idle):\n"
            << gantt_chart(schedule) << "\n";
  char line[256];
  std::snprintf(line, sizeof(line),
                "Bubble ratio: %lld idle of %lld slots = %.1f%% ((S-1)/(M+S-1) = %d/%d); "
                "ideal speedup over one stage S*M/(M+S-1) = %.2fx\n",
                static_cast<long long>(schedule.idle_slots()),
                static_cast<long long>(schedule.total_slots()), 100.0 * schedule.bubble_ratio(),
                s - 1, m + s - 1, static_cast<double>(s) * m / (m + s - 1));
  std::cout << line;
}

// The per-device view every schedule shares: action lists, unit-time Gantt chart, bubble, peaks.
void print_training_schedule(const TrainingSchedule& schedule) {
  const Timeline timeline = simulate_unit_time(schedule);  // validates the schedule first
  const int s = schedule.devices;
  const int m = schedule.micro_batches;
  const int v = schedule.virtual_stages;
  const bool chunks = v > 1;
  std::cout << "Actions per device, in order (" << (chunks ? "F<i>.<c> / B<i>.<c>" : "F<i> / B<i>")
            << " forward / backward of micro-batch i"
            << (chunks ? " on the device's chunk c, stage c*S + device" : "") << "):\n"
            << format_actions(schedule) << "\n";
  std::cout << "Unit-time Gantt chart (every action one tick; a device starts its next action in "
               "the tick after its inputs are ready, . = idle):\n"
            << format_timeline(timeline) << "\n";
  char line[256];
  std::snprintf(line, sizeof(line),
                "Unit-time bubble ratio: %lld idle of %lld slots = %.1f%% "
                "(for reference (S-1)/(%sM+S-1) = %d/%d)\n",
                static_cast<long long>(timeline.idle_slots()),
                static_cast<long long>(timeline.total_slots()), 100.0 * timeline.bubble,
                chunks ? "V*" : "", s - 1, v * m + s - 1);
  std::cout << line;
  std::cout << (chunks ? "Peak in-flight (micro-batch, chunk) activations per device:"
                       : "Peak in-flight micro-batches per device:");
  for (int peak : timeline.peak_in_flight) std::cout << " " << peak;
  std::cout << " (forwarded, not yet backwarded; the schedule's bound is "
            << schedule.in_flight_bound << ")\n";
}

// A zero-bubble schedule on the paper's clock (F, B and W one tick each) beside 1F1B on the same
// clock (its whole backward two ticks; for zbv, whose chunks are half a stage, every 1F1B action
// takes twice as long), with the paper's bubble formulas.
void print_zero_bubble_schedule(const TrainingSchedule& schedule) {
  const bool v = schedule.placement == StagePlacement::kV;
  const int s = schedule.devices, m = schedule.micro_batches;
  const Timeline timeline = simulate(schedule, {1, 1, 1});  // validates the schedule first
  const Timeline base = simulate(one_f_one_b_schedule(m, s), v ? ActionTicks{2, 2, 2} : ActionTicks{1, 1, 1});
  std::cout << "Actions per device, in order (F forward, B input-gradient backward, W weight-gradient pass of "
               "micro-batch i"
            << (v ? " on the device's chunk c: stage c for c = 0 on device d is d, for c = 1 it is 2S-1-d" : "")
            << "):\n"
            << format_actions(schedule) << "\n";
  std::cout << "Gantt chart, F, B and W one tick each" << (v ? " (a chunk is half a device's layers)" : "")
            << ":\n"
            << format_timeline(timeline) << "\n";
  std::cout << "1F1B on the same clock (its whole backward B+W" << (v ? ", each action a whole stage" : "")
            << "):\n"
            << format_timeline(base) << "\n";
  char line[320];
  std::snprintf(line, sizeof(line),
                "Bubble ratio: %.1f%% against 1F1B's %.1f%% (%.2fx); the paper's formulas with F = B = W: "
                "1F1B (S-1)/(M+S-1) = %d/%d",
                100.0 * timeline.bubble, 100.0 * base.bubble, base.bubble > 0 ? timeline.bubble / base.bubble : 0.0,
                s - 1, m + s - 1);
  std::cout << line;
  if (!v) std::cout << ", ZB-H1 (S-1)/(3M+S-1) = " << s - 1 << "/" << 3 * m + s - 1 << " for M >= S";
  std::cout << "\n";
  std::cout << (v ? "Peak in-flight (micro-batch, chunk) activations per device:" : "Peak in-flight micro-batches per device:");
  for (int peak : timeline.peak_in_flight) std::cout << " " << peak;
  std::cout << " (forwarded, not yet through their W; the schedule's bound is " << schedule.in_flight_bound
            << (v ? " half stages, 1F1B's " + std::to_string(std::min(s, m)) + " whole ones" : ", 1F1B's") << ")\n";
}

// ZB-V as a run of `config` orders it: its default split into 2 S stages, each stage's F, B and
// W estimated from the shapes, the order made on that clock; then both orders' steps on it.
void print_costed_zbv(const Config& c) {
  const harness::model::GPT2Config config = harness::apps::preset_with_vocabulary(c.model, "--model " + c.model);
  const int s = c.stages, m = c.micro_batches;
  std::vector<int> halves = balance_gpt2_for_zbv(config, s, m, c.rows, c.tokens);
  if (!c.balance.empty()) {
    const BalanceSpec given = parse_balance(c.balance);
    if (given.automatic) throw std::invalid_argument("--balance auto times the model: give its split by hand");
    check_halves(given.halves_per_stage, static_cast<int>(config.n_layer), 2 * s,
                 std::to_string(s) + " devices x 2 chunks");
    halves = given.halves_per_stage;
  }
  const std::vector<ActionTicks> ticks = estimate_gpt2_stage_ticks(config, halves, c.rows, c.tokens);
  const TrainingSchedule schedule = zbv_schedule(m, s, ticks);
  std::cout << "ZB-V schedule: S=" << s << " devices x 2 chunks = " << 2 * s << " stages in a V, M=" << m
            << " micro-batches, ordered on " << c.model << "'s estimated costs at micro-batches of " << c.rows
            << " x " << c.tokens << " tokens, as a run orders it\n";
  std::cout << "Stages (blocks each, " << (c.balance.empty() ? "the default split" : "--balance") << "): "
            << format_halves(halves) << "\n";
  std::cout << "Estimated ticks per stage, F/B/W (the largest action 1000):";
  for (const ActionTicks& t : ticks) std::cout << " " << t.forward << "/" << t.input_gradient << "/" << t.weight_gradient;
  std::cout << "\n\n";
  print_zero_bubble_schedule(schedule);
  const Timeline costed = simulate(schedule, ticks);
  const Timeline paper = simulate(zbv_schedule(m, s), ticks);
  char line[256];
  std::snprintf(line, sizeof(line),
                "On the estimated ticks: this order's step %d ticks, bubble %.1f%%; the paper's order (above "
                "without --model) %d ticks, bubble %.1f%%\n",
                costed.ticks, 100.0 * costed.bubble, paper.ticks, 100.0 * paper.bubble);
  std::cout << line;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = "Pipeline training schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) for S "
                           "stages and M micro-batches: per-device actions, Gantt chart, bubble";
  cxxopts::Options options("pipeline_schedule", what);
  options.add_options()
      ("schedule", "gpipe, 1f1b, interleaved, zb1p or zbv",
       cxxopts::value<std::string>()->default_value("gpipe"))
      ("stages", "pipeline stages (devices) S", cxxopts::value<std::string>()->default_value("4"))
      ("micro_batches", "micro-batches per batch M",
       cxxopts::value<std::string>()->default_value("6"))
      ("virtual_stages", "model chunks per device V (interleaved only; default 2 there, else 1)",
       cxxopts::value<std::string>())
      ("model", "zbv: order it on this GPT-2's estimated stage costs, as a run does (NAME or NAME:VOCAB)",
       cxxopts::value<std::string>()->default_value(""))
      ("balance", "with --model: its 2S stages' blocks, N,N,... with N.5 a half block (default: by costs)",
       cxxopts::value<std::string>()->default_value(""))
      ("rows", "rows per micro-batch, with --model", cxxopts::value<std::string>()->default_value("8"))
      ("tokens", "tokens per row, with --model", cxxopts::value<std::string>()->default_value("128"))
      ("h,help", "this help");
  Config config;
  try {
    const cxxopts::ParseResult result = options.parse(argc, argv);
    if (result.count("help")) {
      std::cout << harness::apps::one_line_help(options, what);
      return 0;
    }
    config = parse_config(result);
  } catch (const std::exception& e) {
    std::cerr << "pipeline_schedule: " << e.what() << " (see --help)" << std::endl;
    return 2;
  }

  const int s = config.stages;
  const int m = config.micro_batches;
  const int v = config.virtual_stages;
  try {
    if (config.schedule == "gpipe") {
      print_gpipe_clock_schedule(s, m);
      std::cout << "\nThe same step as per-device action lists (unit time):\n\n";
      print_training_schedule(gpipe_schedule(m, s));
    } else if (config.schedule == "1f1b") {
      std::cout << "1F1B schedule: S=" << s << " devices, M=" << m
                << " micro-batches; device d runs min(S-d-1, M) warm-up forwards, then one "
                   "forward one backward\n\n";
      print_training_schedule(one_f_one_b_schedule(m, s));
    } else if (config.schedule == "zb1p") {
      std::cout << "ZB-H1 schedule: S=" << s << " devices, M=" << m
                << " micro-batches; 1F1B's forwards and input-gradient backwards, device d delaying d "
                   "weight-gradient passes into its cool-down\n\n";
      print_zero_bubble_schedule(zb1p_schedule(m, s));
    } else if (config.schedule == "zbv" && !config.model.empty()) {
      print_costed_zbv(config);
    } else if (config.schedule == "zbv") {
      std::cout << "ZB-V schedule: S=" << s << " devices x 2 chunks = " << 2 * s << " stages in a V, M=" << m
                << " micro-batches; device d holds stages d and " << 2 * s - 1 << "-d\n\n";
      print_zero_bubble_schedule(zbv_schedule(m, s));
    } else {
      std::cout << "Interleaved 1F1B schedule: S=" << s << " devices x V=" << v
                << " chunks = " << s * v << " virtual stages, M=" << m
                << " micro-batches; device d holds chunks d, d+S, ...\n\n";
      print_training_schedule(interleaved_schedule(m, s, v));
    }
  } catch (const std::exception& e) {
    std::cerr << "pipeline_schedule: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
