// allreduce_bench: bus bandwidth of the built-in (Gloo) all-reduce and of the ring all-reduce on
// point-to-point send/recv, for float32 messages from --min_bytes to --max_bytes (doubling), on
// CPU processes. Started plainly it launches --world_size copies of itself (as run_data_parallel
// does); started by torchrun-style variables it is one rank. Rank 0 prints a table and writes
// --out (JSON) for scripts/plot_allreduce.py.
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cxxopts.hpp>
#include <fstream>
#include <iostream>
#include <optional>

#include "help.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/data_parallel/ring_all_reduce.h"

namespace dp = harness::data_parallel;

namespace {

struct BenchFlags {
  int world_size = 2;
  int64_t min_bytes = 1024;
  int64_t max_bytes = 64 << 20;
  int iters = 20;
  std::string out = "allreduce_bench.json";
  std::string master_addr;
  int master_port = 0;
};

BenchFlags parse(int argc, char** argv) {
  const std::string what = "bus bandwidth of builtin vs ring all-reduce against message size (CPU, Gloo)";
  cxxopts::Options options("allreduce_bench", what);
  options.add_options()
      ("world_size", "ranks (processes started here)", cxxopts::value<int>()->default_value("2"))
      ("min_bytes", "smallest message (bytes, float32)", cxxopts::value<int64_t>()->default_value("1024"))
      ("max_bytes", "largest message; sizes double from --min_bytes", cxxopts::value<int64_t>()->default_value("67108864"))
      ("iters", "timed iterations per size (fewer above 16 MiB: 512 MiB per size at most, 3 at least)", cxxopts::value<int>()->default_value("20"))
      ("out", "JSON file rank 0 writes", cxxopts::value<std::string>()->default_value("allreduce_bench.json"))
      ("master_addr", "rendezvous host (default: $MASTER_ADDR or localhost)", cxxopts::value<std::string>()->default_value(""))
      ("master_port", "rendezvous port (default: $MASTER_PORT or 11868)", cxxopts::value<int>()->default_value("0"))
      ("h,help", "this help");
  BenchFlags f;
  try {
    const cxxopts::ParseResult r = options.parse(argc, argv);
    if (r.count("help")) {
      std::cout << harness::apps::one_line_help(options, what);
      std::exit(0);
    }
    if (!r.unmatched().empty()) {
      throw std::invalid_argument("unexpected argument '" + r.unmatched().front() + "'");
    }
    f.world_size = r["world_size"].as<int>();
    f.min_bytes = r["min_bytes"].as<int64_t>();
    f.max_bytes = r["max_bytes"].as<int64_t>();
    f.iters = r["iters"].as<int>();
    f.out = r["out"].as<std::string>();
    f.master_addr = r["master_addr"].as<std::string>();
    f.master_port = r["master_port"].as<int>();
    if (f.world_size < 2) {
      throw std::invalid_argument("--world_size " + std::to_string(f.world_size) +
                                  " must be at least 2 (one rank has nothing to reduce)");
    }
    if (f.min_bytes < 4 || f.max_bytes < f.min_bytes) {
      throw std::invalid_argument("--min_bytes " + std::to_string(f.min_bytes) + " and --max_bytes " +
                                  std::to_string(f.max_bytes) +
                                  ": need 4 <= min_bytes <= max_bytes (float32 elements)");
    }
    if (f.iters < 1) throw std::invalid_argument("--iters " + std::to_string(f.iters) + " must be at least 1");
  } catch (const std::exception& e) {
    std::cerr << "allreduce_bench: " << e.what() << "\n(see --help)" << std::endl;
    std::exit(2);
  }
  return f;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

// Same on every rank: a function of the size only.
int iterations_for(int64_t bytes, int iters) {
  const int64_t budget = int64_t{512} << 20;
  return static_cast<int>(std::max<int64_t>(3, std::min<int64_t>(iters, budget / bytes)));
}

double max_over_ranks(const dp::DistContext& ctx, double value) {
  std::vector<at::Tensor> t{torch::tensor({value}, torch::kFloat64)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  ctx.group->allreduce(t, options)->wait();
  return t[0].item<double>();
}

int run_worker(const BenchFlags& flags, const dp::WorkerEnv& env) {
  at::set_num_threads(1);  // one core per rank; the ranks share the machine
  const dp::DistOptions options = dp::dist_options_for(env, dp::Backend::kGloo);
  const dp::DistContext ctx = dp::init_process_group(options);
  const int n = ctx.world_size;
  const double bus_factor = 2.0 * (n - 1) / n;

  nlohmann::json results = nlohmann::json::array();
  if (ctx.rank == 0) {
    std::printf("%12s %10s %6s %12s %12s %12s %12s\n", "bytes", "elements", "iters",
                "builtin_ms", "builtin_GB/s", "ring_ms", "ring_GB/s");
  }
  for (int64_t bytes = flags.min_bytes; bytes <= flags.max_bytes; bytes *= 2) {
    const int64_t elements = bytes / 4;
    const int iters = iterations_for(bytes, flags.iters);
    at::Tensor buffer = torch::empty({elements}, torch::kFloat32);
    double seconds[2] = {0, 0};
    for (int a = 0; a < 2; ++a) {
      const auto algorithm = a == 0 ? dp::AllReduceAlgorithm::kBuiltin : dp::AllReduceAlgorithm::kRing;
      // One untimed round, checked: every rank contributes rank + 1.
      buffer.fill_(ctx.rank + 1);
      dp::all_reduce(ctx, buffer, algorithm);
      const float want = n * (n + 1) / 2.0f;
      if (!torch::equal(buffer, torch::full_like(buffer, want))) {
        throw std::runtime_error(dp::to_string(algorithm) + " all-reduce of " +
                                 std::to_string(bytes) + " bytes gave a wrong sum");
      }
      std::vector<double> times;
      for (int k = 0; k < iters; ++k) {
        buffer.fill_(ctx.rank + 1);
        dp::barrier(ctx);  // start together, so the time is the collective's, not a straggler's
        const auto start = std::chrono::steady_clock::now();
        dp::all_reduce(ctx, buffer, algorithm);
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      // The median resists the other work a shared machine does; the slowest rank's counts.
      std::nth_element(times.begin(), times.begin() + iters / 2, times.end());
      seconds[a] = max_over_ranks(ctx, times[static_cast<size_t>(iters / 2)]);
      results.push_back({{"algorithm", dp::to_string(algorithm)},
                         {"bytes", bytes},
                         {"elements", elements},
                         {"iters", iters},
                         {"time_s", seconds[a]},
                         {"algbw_GBps", bytes / seconds[a] / 1e9},
                         {"busbw_GBps", bus_factor * bytes / seconds[a] / 1e9}});
    }
    if (ctx.rank == 0) {
      std::printf("%12lld %10lld %6d %12.3f %12.3f %12.3f %12.3f\n", static_cast<long long>(bytes),
                  static_cast<long long>(elements), iters, seconds[0] * 1e3,
                  bus_factor * bytes / seconds[0] / 1e9, seconds[1] * 1e3,
                  bus_factor * bytes / seconds[1] / 1e9);
      std::fflush(stdout);
    }
  }
  if (ctx.rank == 0) {
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    const nlohmann::json doc = {{"world_size", n},
                                {"backend", dp::to_string(ctx.backend)},
                                {"device", "cpu"},
                                {"dtype", "float32"},
                                {"host", host},
                                {"cores", static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN))},
                                {"threads_per_rank", 1},
                                {"bus_bandwidth", "2(N-1)/N * bytes / time, time the slowest rank's median"},
                                {"results", results}};
    std::ofstream out(flags.out);
    if (!out) throw std::runtime_error("--out " + flags.out + ": cannot open for writing");
    out << doc.dump(2) << "\n";
    std::printf("allreduce_bench: wrote %s\n", flags.out.c_str());
  }
  dp::barrier(ctx);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const BenchFlags flags = parse(argc, argv);
  try {
    if (const std::optional<dp::WorkerEnv> env = dp::worker_env_from_environment()) {
      return run_worker(flags, *env);
    }
    const std::string addr = !flags.master_addr.empty() ? flags.master_addr : env_or("MASTER_ADDR", "localhost");
    const int port = flags.master_port > 0
                         ? flags.master_port
                         : std::atoi(env_or("MASTER_PORT", std::to_string(dp::kDefaultMasterPort)).c_str());
    return dp::launch_workers(std::vector<std::string>(argv, argv + argc), flags.world_size, addr, port);
  } catch (const std::exception& e) {
    std::cerr << "allreduce_bench: error: " << e.what() << std::endl;
    return 1;
  }
}
