// Helpers for the tensor-parallel multi-process tests: the test binary re-runs itself as workers
// (HARNESS_TEST_WORKER names the scenario, --gtest_filter selects TpWorker.Run).
#pragma once

#include <stdlib.h>

#include <string>
#include <utility>
#include <vector>

#include "../data_parallel/test_support.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/config.h"

namespace harness::tensor_parallel::testing {

using data_parallel::testing::CapturedLaunch;
using data_parallel::testing::free_port;
using data_parallel::testing::kWorkerVariable;
using data_parallel::testing::remove_tree;
constexpr const char* kDirVariable = "HARNESS_TEST_TP_DIR";

// Runs `world_size` copies of this test binary in scenario `scenario` (TpWorker.Run).
inline CapturedLaunch launch_scenario(const std::string& scenario, int world_size,
                                      std::vector<std::pair<std::string, std::string>> env = {}) {
  return data_parallel::testing::launch_test_workers("tensor_parallel_tests", "TpWorker.Run", scenario,
                                                     world_size, std::move(env));
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
