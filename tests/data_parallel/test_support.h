// Helpers for the data-parallel multi-process tests (tests/support/multi_process.h is the
// harness): the test binary re-runs itself as workers of scenario DpWorker.Run.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../support/multi_process.h"
#include "harness/data_parallel/process_group.h"

namespace harness::data_parallel::testing {

using namespace harness::test_workers;

// A world of this process alone (Gloo on a free port).
inline DistContext one_rank() {
  DistOptions o;
  o.master_port = free_port();
  o.timeout = std::chrono::seconds(30);
  return init_process_group(o);
}

// Runs `world_size` copies of this test binary in scenario `scenario` (DpWorker.Run).
inline CapturedLaunch launch_scenario(const std::string& scenario, int world_size,
                                      std::vector<std::pair<std::string, std::string>> env = {},
                                      std::chrono::milliseconds kill_grace = std::chrono::seconds(5),
                                      const std::function<void(LaunchOptions&)>& customize = {}) {
  return launch_test_workers("data_parallel_tests", "DpWorker.Run", scenario, world_size,
                             std::move(env), kill_grace, customize);
}

}  // namespace harness::data_parallel::testing
