// Worker threads: grad mode carried over, failures re-raised on the caller, threads joined.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "harness/pipeline/worker.h"
#include "test_support.h"

namespace harness::pipeline {
namespace {

using testing::thread_count;
using testing::thread_count_settled;
using testing::thread_count_stable;

TEST(Worker, RunsTasksOnItsOwnThreadUnderTheCallersGradMode) {
  Worker worker(Device::cpu(1), 1);
  std::thread::id ran_on;
  bool grad_enabled = true;
  int width = 0;
  {
    torch::NoGradGuard no_grad;
    run_concurrently({{&worker, [&] {
                         ran_on = std::this_thread::get_id();
                         grad_enabled = torch::GradMode::is_enabled();
                         width = at::get_num_threads();
                       }, "probe"}});
  }
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_FALSE(grad_enabled);
  EXPECT_EQ(width, 1);
  run_concurrently({{&worker, [&] { grad_enabled = torch::GradMode::is_enabled(); }, "probe"}});
  EXPECT_TRUE(grad_enabled);
}

TEST(Worker, FailureNamesTaskAndDeviceAndWaitsForTheOthers) {
  const size_t before = thread_count_stable();
  {
    Workers workers({Device::cpu(0), Device::cpu(1)}, 1);
    std::atomic<bool> slow_done{false};
    try {
      run_concurrently({{&workers.at(Device::cpu(0)), [] { throw std::logic_error("boom 42"); }, "forward of micro-batch 3, partition 0"},
                        {&workers.at(Device::cpu(1)), [&] {
                           std::this_thread::sleep_for(std::chrono::milliseconds(50));
                           slow_done = true;
                         }, "slow"}});
      FAIL() << "expected the task's exception";
    } catch (const std::runtime_error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("boom 42"), std::string::npos) << message;
      EXPECT_NE(message.find("micro-batch 3"), std::string::npos) << message;
      EXPECT_NE(message.find("cpu:0"), std::string::npos) << message;
    }
    EXPECT_TRUE(slow_done);
    // The worker that failed still serves later tasks.
    int value = 0;
    run_concurrently({{&workers.at(Device::cpu(0)), [&] { value = 7; }, "after"}});
    EXPECT_EQ(value, 7);
    EXPECT_EQ(thread_count(), before + 2);
  }
  EXPECT_EQ(thread_count_settled(before), before);
}

TEST(Worker, TorchErrorsKeepTheirMessageWithoutBacktrace) {
  Worker worker(Device::cpu(0), 1);
  try {
    run_concurrently({{&worker, [] { torch::mm(torch::ones({2, 3}), torch::ones({2, 3})); }, "matmul"}});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("matmul on cpu:0 failed: ", 0), 0u) << message;
    EXPECT_NE(message.find("2x3"), std::string::npos) << message;
  }
}

TEST(Worker, OneWorkerPerDistinctDevice) {
  Workers workers({Device::cpu(0), Device::cpu(1), Device::cpu(0)}, 1);
  EXPECT_EQ(workers.size(), 2u);
  EXPECT_THROW(workers.at(Device::cpu(5)), std::out_of_range);
}

}  // namespace
}  // namespace harness::pipeline
