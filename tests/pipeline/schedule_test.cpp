// clock_cycles and its backward counterpart against the original's literal tables and the
// definition (a5_2_1).
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "harness/pipeline/schedule.h"

namespace harness::pipeline {
namespace {

TEST(Schedule, a5_2_1_ClockCyclesMatchesTheSpecTable) {
  const std::vector<Cycle> expected = {{{0, 0}},
                                       {{1, 0}, {0, 1}},
                                       {{2, 0}, {1, 1}, {0, 2}},
                                       {{2, 1}, {1, 2}},
                                       {{2, 2}}};
  EXPECT_EQ(clock_cycles(3, 3), expected);
}

TEST(Schedule, a5_2_1_ClockCyclesThreeMicroBatchesTwoPartitions) {
  const std::vector<Cycle> expected = {{{0, 0}}, {{1, 0}, {0, 1}}, {{2, 0}, {1, 1}}, {{2, 1}}};
  EXPECT_EQ(clock_cycles(3, 2), expected);
}

// The original's test_clock_cycles_0: m = 6 micro-batches, n = 2 partitions, as a literal table.
TEST(Schedule, a5_2_1_test_clock_cycles_0) {
  const std::vector<Cycle> expected = {{{0, 0}},         {{1, 0}, {0, 1}}, {{2, 0}, {1, 1}},
                                       {{3, 0}, {2, 1}}, {{4, 0}, {3, 1}}, {{5, 0}, {4, 1}},
                                       {{5, 1}}};
  EXPECT_EQ(clock_cycles(6, 2), expected);
}

TEST(Schedule, a5_2_1_EveryShapeUpTo8x8FollowsTheDefinition) {
  for (int m = 1; m <= 8; ++m) {
    for (int n = 1; n <= 8; ++n) {
      const std::vector<Cycle> cycles = clock_cycles(m, n);
      ASSERT_EQ(static_cast<int>(cycles.size()), m + n - 1) << "m=" << m << " n=" << n;
      std::set<std::pair<int, int>> seen;
      for (int k = 0; k < m + n - 1; ++k) {
        Cycle expected;
        for (int i = m - 1; i >= 0; --i) {
          if (k - i >= 0 && k - i < n) expected.emplace_back(i, k - i);
        }
        EXPECT_EQ(cycles[k], expected) << "m=" << m << " n=" << n << " k=" << k;
        for (const auto& task : cycles[k]) EXPECT_TRUE(seen.insert(task).second);
      }
      EXPECT_EQ(static_cast<int>(seen.size()), m * n);
    }
  }
}

TEST(Schedule, BackwardRunsEachTaskAfterItsSuccessor) {
  const std::vector<Cycle> expected = {{{2, 2}},
                                       {{1, 2}, {2, 1}},
                                       {{0, 2}, {1, 1}, {2, 0}},
                                       {{0, 1}, {1, 0}},
                                       {{0, 0}}};
  EXPECT_EQ(backward_clock_cycles(3, 3), expected);
  for (int m = 1; m <= 8; ++m) {
    for (int n = 1; n <= 8; ++n) {
      std::map<std::pair<int, int>, int> cycle_of;
      const auto cycles = backward_clock_cycles(m, n);
      for (int k = 0; k < static_cast<int>(cycles.size()); ++k) {
        for (const auto& task : cycles[k]) cycle_of[task] = k;
      }
      ASSERT_EQ(static_cast<int>(cycle_of.size()), m * n);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j + 1 < n; ++j) EXPECT_LT((cycle_of[{i, j + 1}]), (cycle_of[{i, j}]));
      }
    }
  }
}

TEST(Schedule, RejectsEmptyShapes) {
  EXPECT_THROW(clock_cycles(0, 2), std::invalid_argument);
  EXPECT_THROW(clock_cycles(2, 0), std::invalid_argument);
}

}  // namespace
}  // namespace harness::pipeline
