// keep_freed_host_memory: a large tensor allocated again after it was freed reuses the memory
// already mapped instead of faulting every page in anew.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include "harness/host_memory.h"

namespace harness {
namespace {

long minor_faults() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

TEST(HostMemory, AFreedLargeTensorIsReusedWithoutPageFaults) {
  keep_freed_host_memory();
  const int64_t floats = 64 * 1024 * 1024 / 4;  // 64 MB: above glibc's largest mmap threshold
  // A step's worth of memory, freed: what the next step allocates again.
  { torch::Tensor step = torch::ones({4 * floats}); }
  const long before = minor_faults();
  {
    torch::Tensor again = torch::ones({floats});
    EXPECT_EQ(again.sum().item<double>(), static_cast<double>(floats));
  }
  const long pages = 64 * 1024 * 1024 / 4096;
  // Without reuse every one of the 16,384 pages faults again.
  EXPECT_LT(minor_faults() - before, pages / 10);
}

TEST(HostMemory, WhatIsFreedCanBeGivenBack) {
  keep_freed_host_memory();
  const int64_t bytes = 256 * 1024 * 1024;
  const int64_t before = resident_memory_bytes();
  ASSERT_GT(before, 0);
  // Kept by the heap after it is freed (the policy above), beneath a tensor still held.
  torch::Tensor freed = torch::ones({bytes / 4});
  torch::Tensor held = torch::ones({1024 * 1024});
  freed = torch::Tensor();
  EXPECT_GT(resident_memory_bytes() - before, bytes * 9 / 10);
  const int64_t given = give_back_freed_host_memory();
  EXPECT_GT(given, bytes * 9 / 10);
  EXPECT_LT(resident_memory_bytes() - before, bytes / 10);
  EXPECT_EQ(held.sum().item<double>(), 1024.0 * 1024.0);
}

}  // namespace
}  // namespace harness
