// GPipe clock cycles.
#include "harness/pipeline/schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace harness::pipeline {

std::vector<Cycle> clock_cycles(int m, int n) {
  if (m < 1 || n < 1) {
    throw std::invalid_argument("clock_cycles: need at least one micro-batch and one partition, got m=" +
                                std::to_string(m) + ", n=" + std::to_string(n));
  }
  std::vector<Cycle> cycles(m + n - 1);
  for (int k = 0; k < m + n - 1; ++k) {
    for (int i = std::min(k, m - 1); i >= 0 && k - i < n; --i) cycles[k].emplace_back(i, k - i);
  }
  return cycles;
}

std::vector<Cycle> backward_clock_cycles(int m, int n) {
  std::vector<Cycle> cycles = clock_cycles(m, n);
  std::reverse(cycles.begin(), cycles.end());
  for (Cycle& cycle : cycles) std::reverse(cycle.begin(), cycle.end());
  return cycles;
}

}  // namespace harness::pipeline
