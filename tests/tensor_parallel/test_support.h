// Helpers for the tensor-parallel multi-process tests: the test binary re-runs itself as workers
// (HARNESS_TEST_WORKER names the scenario, --gtest_filter selects TpWorker.Run).
#pragma once

#include <arpa/inet.h>
#include <ftw.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/config.h"

namespace harness::tensor_parallel::testing {

constexpr const char* kWorkerVariable = "HARNESS_TEST_WORKER";
constexpr const char* kDirVariable = "HARNESS_TEST_TP_DIR";

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

struct CapturedLaunch {
  data_parallel::LaunchResult result;
  std::vector<std::string> lines;
  std::string joined() const {
    std::string all;
    for (const auto& l : lines) all += l + "\n";
    return all;
  }
};

inline CapturedLaunch launch_scenario(const std::string& scenario, int world_size,
                                      std::vector<std::pair<std::string, std::string>> env = {}) {
  auto captured = std::make_shared<CapturedLaunch>();
  auto mutex = std::make_shared<std::mutex>();
  data_parallel::LaunchOptions options;
  options.extra_env = std::move(env);
  options.extra_env.emplace_back(kWorkerVariable, scenario);
  options.sink = [captured, mutex](int, bool is_stderr, const std::string& line) {
    std::lock_guard<std::mutex> lock(*mutex);
    captured->lines.push_back((is_stderr ? "err: " : "out: ") + line);
  };
  captured->result = data_parallel::run_workers(
      {"tensor_parallel_tests", "--gtest_filter=TpWorker.Run"}, world_size, "localhost", free_port(), options);
  // Exit code 0 alone would also pass a worker whose filter matched no test: every rank must
  // also say that it played the scenario through.
  if (captured->result.exit_code == 0) {
    const std::string all = captured->joined();
    for (int rank = 0; rank < world_size; ++rank) {
      const std::string line = "scenario " + scenario + " passed on rank " + std::to_string(rank);
      if (all.find(line) == std::string::npos) {
        captured->result.exit_code = 1;
        captured->result.failure = "rank " + std::to_string(rank) + " exited 0 without \"" + line + "\"";
        break;
      }
    }
  }
  return *captured;
}

// Not std::filesystem::remove_all: LibTorch's exported copy of it crashes in this build.
inline void remove_tree(const std::string& path) {
  ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
         16, FTW_DEPTH | FTW_PHYS);
}

inline std::string make_temp_dir() {
  std::string pattern = "/tmp/harness-tp-XXXXXX";
  return ::mkdtemp(pattern.data()) ? pattern : std::string();
}

// A GPT-2 small enough for multi-process tests, without dropout (so the split and the unsplit
// model compute the same function).
inline model::GPT2Config tiny_config() {
  model::GPT2Config config;
  config.vocab_size = 61;
  config.n_positions = 16;
  config.n_embd = 32;
  config.n_layer = 2;
  config.n_head = 4;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  return config;
}

}  // namespace harness::tensor_parallel::testing
