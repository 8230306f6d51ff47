// step_breakdown: where one GPT-2 training step's time goes, by kind of work. One process trains
// --model (GPT2TrainStep: forward, SPEC §3's loss, backward, AdamW) on random token batches; after
// --warmup steps it times --steps more while a RecordFunction callback on this thread takes every
// ATen op's self time (its time minus its children's). CPU autograd runs backward on the calling
// thread, so forward and backward ops are both seen. Each op's self time goes to a category by its
// name; everything between after_backward and the step's end is the optimizer's; what no op
// accounts for (the autograd engine, allocation, the step's own code) is "outside ATen ops".
// Writes --out (JSON) and prints a table: the figures behind README's breakdown.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cxxopts.hpp>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "help.h"
#include "harness/model/gpt2.h"
#include "harness/host_memory.h"
#include "harness/model/precision.h"
#include "harness/train/step/build_step.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Frame {
  Clock::time_point start;
  double children = 0.0;  // seconds spent in nested ops
};

// This thread's state while recording (the callback is thread-local).
thread_local std::vector<Frame>* frames = nullptr;
thread_local std::map<std::string, double>* self_seconds = nullptr;       // by category
thread_local std::map<std::string, double>* op_self_seconds = nullptr;    // by op name
thread_local bool in_optimizer = false;

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

std::string category_of(const std::string& op) {
  if (in_optimizer) return "optimizer (AdamW)";
  if (contains(op, "scaled_dot_product") || contains(op, "flash_attention") || contains(op, "efficient_attention")) {
    return "attention (fused kernel)";
  }
  if (op == "aten::mm" || op == "aten::addmm" || op == "aten::bmm" || op == "aten::baddbmm" ||
      op == "aten::linear" || op == "aten::matmul" || contains(op, "addmm")) {
    return "matmul (linear layers, head)";
  }
  if (contains(op, "log_softmax") || contains(op, "nll_loss") || contains(op, "cross_entropy")) {
    return "loss over the vocabulary";
  }
  if (contains(op, "layer_norm")) return "layer norm";
  if (op == "aten::copy_" || op == "aten::cat" || op == "aten::contiguous" || op == "aten::clone" ||
      op == "aten::_to_copy" || op == "aten::to" || contains(op, "embedding")) {
    return "copies, cat and embeddings";
  }
  return "other element-wise (gelu, add, mul, dropout, ...)";
}

// An op's or autograd node's kind of work. The backward nodes of our own fused functions
// (CppNode<harness::...>) are the kind of work their forward is.
std::string kind_of(const std::string& name, bool node) {
  if (contains(name, "CppNode<harness::")) {
    return contains(name, "CrossEntropy") ? "loss over the vocabulary"
                                          : "other element-wise (gelu, add, mul, dropout, ...)";
  }
  if (node && !in_optimizer) return "autograd nodes' own time";
  return category_of(name);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  if (frames != nullptr) frames->push_back({Clock::now(), 0.0});
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (frames == nullptr || frames->empty()) return;
  const Frame frame = frames->back();
  frames->pop_back();
  const double total = std::chrono::duration<double>(Clock::now() - frame.start).count();
  const double self = std::max(0.0, total - frame.children);
  if (!frames->empty()) frames->back().children += total;
  const std::string name = fn.name();
  const bool node = fn.scope() == at::RecordScope::BACKWARD_FUNCTION;
  (*self_seconds)[kind_of(name, node)] += self;
  (*op_self_seconds)[name] += self;
}

// The program's flags, with their defaults.
void add_flags(cxxopts::Options& options) {
  options.add_options()
      ("model", "preset", cxxopts::value<std::string>()->default_value("gpt2-mini"))
      ("vocab", "vocab_size (0: the preset's)", cxxopts::value<int64_t>()->default_value("0"))
      ("batch_size", "rows per step", cxxopts::value<int64_t>()->default_value("16"))
      ("model_max_length", "tokens per row", cxxopts::value<int64_t>()->default_value("64"))
      ("steps", "timed steps", cxxopts::value<int>()->default_value("3"))
      ("warmup", "untimed steps first", cxxopts::value<int>()->default_value("2"))
      ("threads", "intra-op threads", cxxopts::value<int>()->default_value("1"))
      ("precision", "fp32 | bf16", cxxopts::value<std::string>()->default_value("fp32"))
      ("out", "JSON file", cxxopts::value<std::string>()->default_value(""))
      ("h,help", "this help");
}

// The --model preset, its vocabulary replaced by --vocab where given, with dropout 0.1 throughout.
harness::model::GPT2Config config_from(const cxxopts::ParseResult& flags) {
  harness::model::GPT2Config config = harness::model::GPT2Config::preset(flags["model"].as<std::string>());
  if (flags["vocab"].as<int64_t>() > 0) config.vocab_size = flags["vocab"].as<int64_t>();
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.1;
  return config;
}

// `gpt2`'s training step at `precision`: the whole model and its AdamW on one process.
harness::train::BuiltStep build_one_process_step(const harness::model::GPT2LMHeadModel& gpt2,
                                                 const std::string& precision) {
  using namespace harness;
  train::TrainStepSettings settings;
  settings.precision = model::parse_precision(precision);
  train::StepComposition composition;
  composition.optimizer = train::OptimizerSettings(1e-4);
  return train::build_step(
      train::RankContext{}, [&gpt2](std::shared_ptr<model::TensorParallelGroup>) { return gpt2; }, composition,
      settings);
}

// What the timed steps recorded: each step's seconds, and the ops' self seconds (summed over the
// steps) by category and by op name.
struct Recording {
  std::vector<double> seconds;
  std::map<std::string, double> by_category, by_op;
};

// Runs `steps` steps on batches from `next_batch`, each timed, with the op callback on this thread.
Recording record_steps(harness::train::TrainStep& step, const std::function<harness::data::Batch()>& next_batch,
                       int steps) {
  Recording recording;
  std::vector<Frame> stack;
  frames = &stack;
  self_seconds = &recording.by_category;
  op_self_seconds = &recording.by_op;
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(on_start, on_end).scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  for (int i = 0; i < steps; ++i) {
    const harness::data::Batch b = next_batch();
    const auto start = Clock::now();
    step.step(b);
    recording.seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    in_optimizer = false;
  }
  at::removeCallback(handle);
  frames = nullptr;
  return recording;
}

// Seconds per step by category, plus what no op accounts for: the mean step less the categories.
// Backward nodes (BACKWARD_FUNCTION scope, e.g. "AddmmBackward0") hold the ATen ops they run,
// counted by those ops' categories; the nodes' own self time is counted apart.
std::map<std::string, double> per_step_by_category(const std::map<std::string, double>& by_category, int steps,
                                                   double mean) {
  std::map<std::string, double> per_step;
  double accounted = 0.0;
  for (const auto& [name, s] : by_category) {
    per_step[name] = s / steps;
    accounted += s / steps;
  }
  per_step["outside ATen ops (autograd engine, allocation, step code)"] = std::max(0.0, mean - accounted);
  return per_step;
}

// The 15 ops with the most self time, in seconds per step.
nlohmann::json top_ops(const std::map<std::string, double>& by_op, int steps) {
  std::vector<std::pair<std::string, double>> ops(by_op.begin(), by_op.end());
  std::sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  nlohmann::json top = nlohmann::json::array();
  for (size_t i = 0; i < ops.size() && i < 15; ++i) top.push_back({{"op", ops[i].first}, {"seconds_per_step", ops[i].second / steps}});
  return top;
}

// The table on stdout: the run in one line, then each category's seconds per step, largest first.
void print_table(const nlohmann::json& out, const std::map<std::string, double>& per_step, int64_t B, int64_t T,
                 int threads, double mean) {
  std::printf("%s, %lld x %lld tokens, %d thread(s), %s: %.3f s per step, %.0f tokens/s\n",
              out["model"].get<std::string>().c_str(), static_cast<long long>(B), static_cast<long long>(T),
              threads, out["precision"].get<std::string>().c_str(), mean,
              out["tokens_per_second"].get<double>());
  std::vector<std::pair<std::string, double>> rows(per_step.begin(), per_step.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  for (const auto& [name, s] : rows) std::printf("  %-58s %8.4f s  %5.1f%%\n", name.c_str(), s, 100.0 * s / mean);
}

}  // namespace

int main(int argc, char** argv) {
  harness::keep_freed_host_memory();  // reuse, not re-fault, the large tensors of each step
  using namespace harness;
  const std::string what = "Where a GPT-2 training step's time goes, by kind of work";
  cxxopts::Options options("step_breakdown", what);
  add_flags(options);
  const auto flags = options.parse(argc, argv);
  if (flags.count("help")) {
    std::cout << harness::apps::one_line_help(options, what);
    return 0;
  }
  try {
    at::set_num_threads(flags["threads"].as<int>());
    const model::GPT2Config config = config_from(flags);
    const int64_t B = flags["batch_size"].as<int64_t>(), T = flags["model_max_length"].as<int64_t>();
    torch::manual_seed(1234);
    model::GPT2LMHeadModel gpt2(config);
    gpt2->reset_parameters();
    train::BuiltStep built = build_one_process_step(gpt2, flags["precision"].as<std::string>());
    train::TrainStep& step = *built.plain;
    step.set_training(true);
    step.after_backward = [] { in_optimizer = true; };
    auto batch = [&] {
      data::Batch b;
      b.input_ids = torch::randint(config.vocab_size, {B, T}, torch::kLong);
      b.labels = torch::randint(config.vocab_size, {B, T}, torch::kLong);
      b.label_token_weights = torch::ones({B, T});
      return b;
    };
    for (int i = 0; i < flags["warmup"].as<int>(); ++i) {
      step.step(batch());
      in_optimizer = false;
    }

    const int steps = flags["steps"].as<int>();
    const Recording recording = record_steps(step, batch, steps);
    double total = 0.0;
    for (double s : recording.seconds) total += s;
    const double mean = total / steps;
    const std::map<std::string, double> per_step = per_step_by_category(recording.by_category, steps, mean);

    nlohmann::json out;
    out["model"] = flags["model"].as<std::string>();
    out["parameters"] = model::count_parameters(*gpt2);
    out["vocab_size"] = config.vocab_size;
    out["batch_size"] = B;
    out["tokens_per_row"] = T;
    out["threads"] = flags["threads"].as<int>();
    out["precision"] = flags["precision"].as<std::string>();
    out["step_seconds_mean"] = mean;
    out["tokens_per_second"] = static_cast<double>(B * T) / mean;
    out["seconds_per_step_by_category"] = per_step;
    out["top_ops_by_self_time"] = top_ops(recording.by_op, steps);
    if (!flags["out"].as<std::string>().empty()) std::ofstream(flags["out"].as<std::string>()) << out.dump(2) << "\n";
    print_table(out, per_step, B, T, flags["threads"].as<int>(), mean);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "step_breakdown: error: " << e.what() << std::endl;
    return 1;
  }
}
