// The one harness of the multi-process tests (data, tensor and pipeline parallel, CUDA): a test
// binary re-runs itself as `world_size` workers under the launcher (HARNESS_TEST_WORKER names the
// scenario, --gtest_filter selects the worker test), and the result counts only when every rank
// says it played the scenario through.
#pragma once

#include <arpa/inet.h>
#include <ftw.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "harness/data_parallel/launcher.h"

namespace harness::test_workers {

using data_parallel::LaunchOptions;
using data_parallel::LaunchResult;
using data_parallel::run_workers;

constexpr const char* kWorkerVariable = "HARNESS_TEST_WORKER";

// A TCP port nothing listens on right now (the kernel's pick, released again).
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
  LaunchResult result;
  std::vector<std::string> lines;  // every forwarded line, "out: " or "err: " first
  std::string joined() const {
    std::string all;
    for (const auto& l : lines) all += l + "\n";
    return all;
  }
};

// Runs `world_size` copies of test binary `binary` (this one, re-executed) with its
// --gtest_filter set to `worker_test`, playing `scenario`. Exit code 0 alone would also pass a
// worker whose filter matched no test: every rank must also report that it played the scenario
// through ("scenario <name> passed on rank <r>"), else the result is a failure.
// `customize` may change the options last (fault injection; a sink of its own that also sees the
// lines, called before the capture).
inline CapturedLaunch launch_test_workers(const std::string& binary, const std::string& worker_test,
                                          const std::string& scenario, int world_size,
                                          std::vector<std::pair<std::string, std::string>> env = {},
                                          std::chrono::milliseconds kill_grace = std::chrono::seconds(5),
                                          const std::function<void(LaunchOptions&)>& customize = {}) {
  auto captured = std::make_shared<CapturedLaunch>();
  auto mutex = std::make_shared<std::mutex>();
  LaunchOptions options;
  options.extra_env = std::move(env);
  options.extra_env.emplace_back(kWorkerVariable, scenario);
  options.kill_grace = kill_grace;
  options.sink = [captured, mutex](int, bool is_stderr, const std::string& line) {
    std::lock_guard<std::mutex> lock(*mutex);
    captured->lines.push_back((is_stderr ? "err: " : "out: ") + line);
  };
  if (customize) {
    auto capture = options.sink;
    customize(options);
    if (options.sink) {
      auto own = options.sink;
      options.sink = [own, capture](int rank, bool is_stderr, const std::string& line) {
        own(rank, is_stderr, line);
        capture(rank, is_stderr, line);
      };
    } else {
      options.sink = capture;
    }
  }
  captured->result = run_workers({binary, "--gtest_filter=" + worker_test}, world_size, "localhost",
                                 free_port(), options);
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

// std::filesystem::remove_all must not be used here: libtorch.so exports its own copy of the
// std::filesystem functions, and remove_all from it crashes (null call) in this build.
inline void remove_tree(const std::string& path) {
  ::nftw(path.c_str(),
         [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

// The body of a worker test (the TEST launch_test_workers runs in each worker): plays the
// scenario the launcher named from `scenarios`, then says that it passed, as launch_test_workers
// requires. Skipped when the test binary runs on its own.
using WorkerScenario = std::function<void(const data_parallel::WorkerEnv&)>;
inline void play_worker_scenario(const std::map<std::string, WorkerScenario>& scenarios) {
  const char* scenario = std::getenv(kWorkerVariable);
  if (scenario == nullptr) GTEST_SKIP() << "only run as a worker by the launcher tests";
  const auto env = data_parallel::worker_env_from_environment();
  ASSERT_TRUE(env.has_value()) << "a worker needs RANK/WORLD_SIZE from the launcher";
  const auto it = scenarios.find(scenario);
  ASSERT_NE(it, scenarios.end()) << "unknown scenario " << scenario;
  it->second(*env);
  if (!::testing::Test::HasFailure()) {
    std::printf("scenario %s passed on rank %d\n", scenario, env->rank);
    std::fflush(stdout);
  }
}

inline bool process_gone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

// A fresh folder under /tmp (empty string if it cannot be made).
inline std::string make_temp_dir(const std::string& prefix = "harness-test") {
  std::string pattern = "/tmp/" + prefix + "-XXXXXX";
  return ::mkdtemp(pattern.data()) ? pattern : std::string();
}

// A fresh folder under /tmp, removed when the process exits: for what a test file keeps in a
// static for all its tests (a trained tokenizer), which no test's teardown may remove.
inline const std::string& folder_removed_at_exit(const std::string& prefix) {
  struct Folder {
    std::string path;
    ~Folder() {
      if (!path.empty()) remove_tree(path);
    }
  };
  static const Folder folder{make_temp_dir(prefix)};
  return folder.path;
}

}  // namespace harness::test_workers
