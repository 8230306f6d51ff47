// Helpers for the tensor-parallel multi-process tests (tests/support/multi_process.h is the
// harness): the test binary re-runs itself as workers of scenario TpWorker.Run.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "../support/multi_process.h"
#include "harness/model/config.h"

namespace harness::tensor_parallel::testing {

using namespace harness::test_workers;
constexpr const char* kDirVariable = "HARNESS_TEST_TP_DIR";

// Runs `world_size` copies of this test binary in scenario `scenario` (TpWorker.Run).
inline CapturedLaunch launch_scenario(const std::string& scenario, int world_size,
                                      std::vector<std::pair<std::string, std::string>> env = {}) {
  return launch_test_workers("tensor_parallel_tests", "TpWorker.Run", scenario, world_size, std::move(env));
}

inline std::string make_temp_dir() { return test_workers::make_temp_dir("harness-tp"); }

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
