// gpu_throughput: single-GPU training throughput of GPT-2 (scripts/run_benchmarks.py --gpu-single).
// For each --tokens length and --precisions entry it finds the largest batch that fits (doubling,
// then bisecting, catching out-of-memory), then times --steps training steps at that batch: the
// step of GPT2TrainStep on one device (forward under autocast in the precision, SPEC §3's loss,
// backward, AdamW), on random token batches made on the GPU. It reports tokens/s, model-FLOPs
// utilisation against the bf16 (and fp32) matmul peak it measures itself first, and the peak of
// memory allocated. Prints one JSON document (and writes --out). Without a GPU it refuses, unless
// --cpu_smoke runs the same path on the CPU with a tiny model (for the tests of the scripts).
#include <ATen/Context.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cxxopts.hpp>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "help.h"
#include "harness/model/config.h"
#include "harness/model/gpt2.h"
#include "harness/model/precision.h"
#include "harness/model/loss.h"

#ifdef HARNESS_WITH_NCCL  // set whenever this LibTorch has CUDA (see CMakeLists.txt)
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#define HARNESS_GPU_STATS 1
#endif

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Flags {
  std::string model = "gpt2";
  std::vector<int64_t> tokens{128, 1024};
  std::vector<std::string> precisions{"fp32", "bf16"};
  int warmup = 2;
  int steps = 5;
  int64_t max_batch = 4096;
  int64_t max_tokens_per_step = int64_t{1} << 20;
  int64_t matmul_size = 8192;
  double time_budget_s = 150.0;
  bool cpu_smoke = false;
  std::string out;
};

std::vector<std::string> split_csv(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

Flags parse(int argc, char** argv) {
  const std::string what = "GPT-2 training throughput on one GPU: tokens/s, MFU against a measured bf16 matmul peak, "
                           "peak memory, at the largest batch that fits";
  cxxopts::Options options("gpu_throughput", what);
  options.add_options()
      ("model", "GPT-2 preset", cxxopts::value<std::string>()->default_value("gpt2"))
      ("tokens", "tokens per example, comma-separated", cxxopts::value<std::string>()->default_value("128,1024"))
      ("precisions", "fp32 and/or bf16 (autocast), comma-separated", cxxopts::value<std::string>()->default_value("fp32,bf16"))
      ("warmup", "untimed steps at the chosen batch", cxxopts::value<int>()->default_value("2"))
      ("steps", "timed steps at the chosen batch (median reported)", cxxopts::value<int>()->default_value("5"))
      ("max_batch", "largest batch tried", cxxopts::value<int64_t>()->default_value("4096"))
      ("max_tokens_per_step", "largest batch x tokens tried", cxxopts::value<int64_t>()->default_value("1048576"))
      ("matmul_size", "N of the N x N x N matmuls that measure the peaks", cxxopts::value<int64_t>()->default_value("8192"))
      ("time_budget_s", "the batch searches stop early once this much time is spent (the timed steps still run)",
       cxxopts::value<double>()->default_value("150"))
      ("cpu_smoke", "run on the CPU with gpt2-tiny, small batches and matmuls: tests this program, measures nothing")
      ("out", "also write the JSON here", cxxopts::value<std::string>()->default_value(""))
      ("h,help", "this help");
  Flags f;
  try {
    const cxxopts::ParseResult r = options.parse(argc, argv);
    if (r.count("help")) {
      std::cout << harness::apps::one_line_help(options, what);
      std::exit(0);
    }
    if (!r.unmatched().empty()) throw std::invalid_argument("unexpected argument '" + r.unmatched().front() + "'");
    f.model = r["model"].as<std::string>();
    f.tokens.clear();
    for (const std::string& t : split_csv(r["tokens"].as<std::string>())) f.tokens.push_back(std::stoll(t));
    f.precisions = split_csv(r["precisions"].as<std::string>());
    f.warmup = r["warmup"].as<int>();
    f.steps = r["steps"].as<int>();
    f.max_batch = r["max_batch"].as<int64_t>();
    f.max_tokens_per_step = r["max_tokens_per_step"].as<int64_t>();
    f.matmul_size = r["matmul_size"].as<int64_t>();
    f.time_budget_s = r["time_budget_s"].as<double>();
    f.cpu_smoke = r.count("cpu_smoke") > 0;
    f.out = r["out"].as<std::string>();
    if (f.tokens.empty() || f.precisions.empty()) throw std::invalid_argument("--tokens and --precisions need values");
    for (int64_t t : f.tokens) {
      if (t < 2) throw std::invalid_argument("--tokens " + std::to_string(t) + " must be at least 2");
    }
    for (const std::string& p : f.precisions) harness::model::parse_precision(p);
    if (f.steps < 1 || f.warmup < 0) throw std::invalid_argument("--steps must be >= 1 and --warmup >= 0");
    if (f.max_batch < 1 || f.max_tokens_per_step < 2 || f.matmul_size < 16) {
      throw std::invalid_argument("--max_batch, --max_tokens_per_step and --matmul_size must be positive");
    }
  } catch (const std::exception& e) {
    std::cerr << "gpu_throughput: " << e.what() << " (see --help)" << std::endl;
    std::exit(2);
  }
  if (f.cpu_smoke) {
    f.model = "gpt2-tiny";
    f.matmul_size = std::min<int64_t>(f.matmul_size, 256);
    f.max_batch = std::min<int64_t>(f.max_batch, 8);
    f.warmup = std::min(f.warmup, 1);
    f.steps = std::min(f.steps, 2);
  }
  return f;
}

void synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// TFLOP/s of an N x N x N matmul in `dtype` (median of timed repeats after warm-ups).
double matmul_tflops(c10::ScalarType dtype, int64_t n, const c10::Device& device) {
  const auto options = torch::TensorOptions().device(device).dtype(dtype);
  const at::Tensor a = torch::randn({n, n}, options), b = torch::randn({n, n}, options);
  for (int k = 0; k < 3; ++k) (void)torch::mm(a, b);
  synchronize(device);
  std::vector<double> seconds;
  const auto start = Clock::now();
  while (seconds.size() < 5 || (seconds.size() < 50 && Clock::now() - start < std::chrono::milliseconds(500))) {
    const auto t0 = Clock::now();
    for (int k = 0; k < 4; ++k) (void)torch::mm(a, b);
    synchronize(device);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / 4);
  }
  std::sort(seconds.begin(), seconds.end());
  return 2.0 * static_cast<double>(n) * n * n / seconds[seconds.size() / 2] / 1e12;
}

// Training FLOPs per token: 6 x the matmul parameters (blocks: 12 L C^2; tied head: V C) plus
// attention's 12 L C T (PaLM, appendix B; causal masking not discounted).
double flops_per_token(const harness::model::GPT2Config& c, int64_t tokens) {
  const double L = static_cast<double>(c.n_layer), C = static_cast<double>(c.n_embd);
  const double matmul_parameters = L * (4 * C * C + 2 * C * static_cast<double>(c.inner_dim())) +
                                   static_cast<double>(c.vocab_size) * C;
  return 6 * matmul_parameters + 12 * L * C * static_cast<double>(tokens);
}

bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  const std::string what = e.what();
  return what.find("out of memory") != std::string::npos || what.find("CUBLAS_STATUS_ALLOC_FAILED") != std::string::npos;
}

void release_cached_memory(const c10::Device& device) {
#ifdef HARNESS_GPU_STATS
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

struct Trainer {
  harness::model::GPT2LMHeadModel model;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  c10::Device device;
  harness::model::Precision precision;

  // One training step on a random batch of `rows` x `tokens`; returns the loss (waits for the GPU).
  double step(int64_t rows, int64_t tokens) {
    const int64_t vocab = model->config().vocab_size;
    const auto ids = torch::TensorOptions().device(device).dtype(torch::kLong);
    const at::Tensor input_ids = torch::randint(vocab, {rows, tokens}, ids);
    const at::Tensor labels = torch::randint(vocab, {rows, tokens}, ids);
    const at::Tensor weights = torch::ones({rows, tokens}, torch::TensorOptions().device(device));
    optimizer->zero_grad(/*set_to_none=*/true);
    at::Tensor loss;
    {
      harness::model::AutocastScope autocast(precision, device.type());
      loss = harness::model::weighted_cross_entropy(model->forward(input_ids), labels, weights);
    }
    loss.backward();
    optimizer->step();
    return loss.item<double>();
  }

  // Whether a step at `rows` fits in memory; an out-of-memory error is caught and its cache freed.
  bool fits(int64_t rows, int64_t tokens, std::string* error) {
    try {
      step(rows, tokens);
      return true;
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e)) throw;
      *error = std::string(e.what()).substr(0, 160);
      optimizer->zero_grad(/*set_to_none=*/true);
      release_cached_memory(device);
      return false;
    }
  }
};

// The matmul peaks that MFU is measured against, in TFLOP/s.
struct Peaks {
  double bf16 = 0.0;
  double fp32 = 0.0;
};

// The batch search's outcome: each batch tried, the largest that fit (0: none), what stopped the
// search ("cap", "out of memory" or "time budget") and the last out-of-memory error.
struct BatchSearch {
  json tries = json::array();
  int64_t largest = 0;
  std::string stopped_by = "cap";
  std::string error;
};

// The largest batch of `tokens`-long rows that fits, up to the flags' caps, searched until `deadline`.
BatchSearch search_batch(Trainer& trainer, const Flags& f, int64_t tokens, const Clock::time_point& deadline) {
  const int64_t cap = std::max<int64_t>(1, std::min(f.max_batch, f.max_tokens_per_step / tokens));
  BatchSearch s;
  auto try_rows = [&](int64_t rows) {
    const auto t0 = Clock::now();
    const bool ok = trainer.fits(rows, tokens, &s.error);
    s.tries.push_back({{"batch", rows}, {"fits", ok}, {"seconds", std::chrono::duration<double>(Clock::now() - t0).count()}});
    if (!ok) s.stopped_by = "out of memory";
    return ok;
  };
  // Doubling from a batch of about 8K tokens (at least 1 row), then bisecting to 1/8 of the last fit.
  int64_t bad = cap + 1;
  int64_t rows = std::clamp<int64_t>(8192 / tokens, 1, cap);
  while (rows <= cap && Clock::now() < deadline) {
    if (!try_rows(rows)) {
      bad = rows;
      break;
    }
    s.largest = rows;
    if (rows == cap) break;
    rows = std::min(cap, rows * 2);
  }
  if (s.largest == 0) return s;
  while (bad - s.largest > std::max<int64_t>(1, s.largest / 8) && Clock::now() < deadline) {
    const int64_t mid = s.largest + (bad - s.largest) / 2;
    if (try_rows(mid)) {
      s.largest = mid;
    } else {
      bad = mid;
    }
  }
  if (Clock::now() >= deadline && s.stopped_by == "cap" && s.largest < cap) s.stopped_by = "time budget";
  return s;
}

// The timed steps: the batch they ran at, each step's seconds, and the last step's loss.
struct TimedSteps {
  int64_t rows = 0;
  std::vector<double> seconds;
  double last_loss = 0.0;
};

// --warmup untimed steps, then --steps timed ones, at `rows` (the memory peaks reset between).
// A batch right at the edge can fit once and fail later (fragmentation): then 7/8 of it, twice.
TimedSteps time_steps(Trainer& trainer, const Flags& f, int64_t rows, int64_t tokens) {
  TimedSteps timed;
  timed.rows = rows;
  for (int attempt = 0;; ++attempt) {
    try {
      timed.seconds.clear();
      for (int k = 0; k < f.warmup; ++k) trainer.step(timed.rows, tokens);
#ifdef HARNESS_GPU_STATS
      if (trainer.device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(trainer.device.index());
#endif
      for (int k = 0; k < f.steps; ++k) {
        const auto t0 = Clock::now();
        timed.last_loss = trainer.step(timed.rows, tokens);  // item() waits for the step's kernels
        timed.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      return timed;
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e) || attempt == 2 || timed.rows < 2) throw;
      trainer.optimizer->zero_grad(/*set_to_none=*/true);
      release_cached_memory(trainer.device);
      timed.rows = std::max<int64_t>(1, timed.rows * 7 / 8);
    }
  }
}

// The peaks of memory allocated and reserved since the timed steps began (allocated: null off CUDA).
void add_peak_memory(json& run, const c10::Device& device) {
#ifdef HARNESS_GPU_STATS
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    run["peak_memory_allocated_bytes"] = stats.allocated_bytes[all].peak;
    run["peak_memory_reserved_bytes"] = stats.reserved_bytes[all].peak;
  }
#endif
  if (!run.contains("peak_memory_allocated_bytes")) run["peak_memory_allocated_bytes"] = nullptr;
}

// One configuration (`tokens`, the trainer's precision): the batch search, then the timed steps at
// the largest batch that fits, their throughput and MFU against `peaks`, and the memory peaks.
json measure(Trainer& trainer, const Flags& f, int64_t tokens, const Peaks& peaks, const Clock::time_point& deadline) {
  json run;
  run["tokens"] = tokens;
  run["precision"] = harness::model::to_string(trainer.precision);
  const BatchSearch search = search_batch(trainer, f, tokens, deadline);
  run["search"] = search.tries;
  if (search.largest == 0) {
    run["error"] = "no batch fits: " + search.error;
    return run;
  }
  run["largest_batch_that_fits"] = search.largest;
  run["search_stopped_by"] = search.stopped_by;

  const TimedSteps timed = time_steps(trainer, f, search.largest, tokens);
  const int64_t good = timed.rows;
  run["batch_size"] = good;
  std::vector<double> sorted = timed.seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double tokens_per_second = static_cast<double>(good * tokens) / median;
  const double achieved = tokens_per_second * flops_per_token(trainer.model->config(), tokens) / 1e12;
  run["step_seconds"] = timed.seconds;
  run["step_seconds_median"] = median;
  run["tokens_per_step"] = good * tokens;
  run["tokens_per_second"] = tokens_per_second;
  run["achieved_tflops"] = achieved;
  run["mfu_vs_bf16_peak"] = achieved / peaks.bf16;
  run["mfu_vs_fp32_peak"] = achieved / peaks.fp32;
  run["last_loss"] = timed.last_loss;
  add_peak_memory(run, trainer.device);
  return run;
}

std::string device_name(const c10::Device& device) {
#ifdef HARNESS_GPU_STATS
  if (device.is_cuda()) return at::cuda::getDeviceProperties(device.index())->name;
#endif
  return "CPU (--cpu_smoke: not a measurement)";
}

// The bf16 and fp32 peaks of `n` x `n` x `n` matmuls on `device`.
Peaks measure_peaks(int64_t n, const c10::Device& device) {
  Peaks peaks;
  peaks.bf16 = matmul_tflops(torch::kBFloat16, n, device);
  peaks.fp32 = matmul_tflops(torch::kFloat32, n, device);
  return peaks;
}

// GPT-2 of `config` (seeded, so every run starts from the same weights) on `device`, in training
// mode, with its AdamW; fp32 until a configuration sets its precision.
Trainer make_trainer(const harness::model::GPT2Config& config, const c10::Device& device) {
  torch::manual_seed(1234);
  Trainer trainer{harness::model::GPT2LMHeadModel(config), nullptr, device, harness::model::Precision::kFp32};
  trainer.model->to(device);
  trainer.model->train();
  trainer.optimizer = std::make_unique<torch::optim::AdamW>(trainer.model->parameters(), torch::optim::AdamWOptions(1e-4));
  return trainer;
}

// When a configuration's search must stop: each of the `left` configurations gets an equal share
// of what is left of the search budget.
Clock::time_point search_deadline(const Flags& f, const Clock::time_point& start, size_t left) {
  const double budget_left = f.time_budget_s - std::chrono::duration<double>(Clock::now() - start).count();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::max(0.0, budget_left) / left));
}

// measure(), or the configuration with its error: one configuration's failure leaves the others' figures.
json measure_or_error(Trainer& trainer, const Flags& f, int64_t tokens, const std::string& precision,
                      const Peaks& peaks, const Clock::time_point& deadline) {
  try {
    return measure(trainer, f, tokens, peaks, deadline);
  } catch (const std::exception& e) {
    return {{"tokens", tokens}, {"precision", precision}, {"error", std::string(e.what()).substr(0, 400)}};
  }
}

// The goal's verdict, from the bf16 run at 1024 tokens (none when that run has no MFU).
void add_goal(json& report, const json& runs) {
  for (const json& run : runs) {
    if (run["tokens"] == 1024 && run["precision"] == "bf16" && run.contains("mfu_vs_bf16_peak")) {
      const double mfu = run["mfu_vs_bf16_peak"].get<double>();
      report["goal"] = {{"what", "bf16 autocast, 1024 tokens per example: MFU >= 0.40 of the measured bf16 peak"},
                        {"mfu", mfu},
                        {"met", mfu >= 0.40}};
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  if (!f.cpu_smoke && !torch::cuda::is_available()) {
    std::cerr << "gpu_throughput: no GPU: torch::cuda::is_available() is false, and this program measures a "
                 "CUDA device (--cpu_smoke runs its code path on the CPU with gpt2-tiny, for tests)"
              << std::endl;
    return 3;
  }
  try {
    const auto start = Clock::now();
    const c10::Device device = f.cpu_smoke ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, 0);
    at::globalContext().setFloat32MatmulPrecision("highest");  // fp32 is IEEE fp32 (no TF32), PyTorch's default
    json report;
    report["program"] = "gpu_throughput";
    report["device"] = device_name(device);
    report["cpu_smoke"] = f.cpu_smoke;
    report["matmul_size"] = f.matmul_size;
    const Peaks peaks = measure_peaks(f.matmul_size, device);
    report["peaks_tflops"] = {{"bf16_matmul", peaks.bf16}, {"fp32_matmul", peaks.fp32}};
    std::cerr << "gpu_throughput: " << report["device"].get<std::string>() << ": matmul peaks bf16 " << peaks.bf16
              << " TFLOP/s, fp32 " << peaks.fp32 << " TFLOP/s" << std::endl;

    const harness::model::GPT2Config config = harness::model::GPT2Config::preset(f.model);
    report["model"] = f.model;
    Trainer trainer = make_trainer(config, device);
    report["parameters"] = harness::model::count_parameters(*trainer.model);
    report["flops_per_token"] = "6 (12 L C^2 + V C) + 12 L C T";
    json runs = json::array();
    // --out holds what is measured so far ("complete": false until the end), so that a run stopped
    // by a timeout still leaves its figures.
    auto write_out = [&](bool complete) {
      if (f.out.empty()) return;
      report["runs"] = runs;
      report["complete"] = complete;
      report["seconds"] = std::chrono::duration<double>(Clock::now() - start).count();
      std::ofstream out(f.out);
      out << report.dump(2) << "\n";
      if (!out) throw std::runtime_error("cannot write --out " + f.out);
    };
    write_out(false);
    const size_t total = f.tokens.size() * f.precisions.size();
    size_t index = 0;
    for (int64_t tokens : f.tokens) {
      if (tokens > config.n_positions) {
        throw std::invalid_argument("--tokens " + std::to_string(tokens) + " exceeds " + f.model + "'s n_positions " +
                                    std::to_string(config.n_positions));
      }
      for (const std::string& precision : f.precisions) {
        trainer.precision = harness::model::parse_precision(precision);
        const auto deadline = search_deadline(f, start, total - index);
        json run = measure_or_error(trainer, f, tokens, precision, peaks, deadline);
        run["flops_per_token"] = flops_per_token(config, tokens);
        std::cerr << "gpu_throughput: " << run.dump() << std::endl;
        runs.push_back(run);
        write_out(false);
        ++index;
        trainer.optimizer->zero_grad(/*set_to_none=*/true);
        release_cached_memory(device);
      }
    }
    report["runs"] = runs;
    add_goal(report, runs);
    write_out(true);
    report["seconds"] = std::chrono::duration<double>(Clock::now() - start).count();
    std::cout << report.dump(2) << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "gpu_throughput: error: " << e.what() << std::endl;
    return 1;
  }
}
