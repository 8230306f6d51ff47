// Helpers the pipeline test files share.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

namespace harness::pipeline::testing {

// The message of the std::invalid_argument `call` throws, or a note that it threw none.
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument thrown)";
}

// Threads of this process now (/proc/self/task).
inline size_t thread_count() {
  size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++count;
  return count;
}

// The thread count once it reaches `expected`, or after 2 s. A joined thread's /proc/self/task
// entry can outlive pthread_join by a moment (the kernel reaps it after the join returns), so a
// single read right after threads were joined may still count one of them.
inline size_t thread_count_settled(size_t expected) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  size_t count = thread_count();
  while (count != expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    count = thread_count();
  }
  return count;
}

// The thread count once it has not changed for 50 ms (at most 2 s): the baseline of a test, read
// after the threads an earlier test joined have left /proc/self/task.
inline size_t thread_count_stable() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  size_t count = thread_count();
  auto since = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() < deadline &&
         std::chrono::steady_clock::now() - since < std::chrono::milliseconds(50)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const size_t now = thread_count();
    if (now != count) {
      count = now;
      since = std::chrono::steady_clock::now();
    }
  }
  return count;
}

}  // namespace harness::pipeline::testing
