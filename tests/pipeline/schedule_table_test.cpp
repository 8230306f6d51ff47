// The GPipe schedule as tables, bubble ratio and Gantt chart, against hand-written tables; all
// built from the clock_cycles / backward_clock_cycles that Pipe executes.
#include <gtest/gtest.h>

#include <cmath>

#include "harness/pipeline/schedule.h"

namespace harness::pipeline {
namespace {

constexpr int _ = kIdle;

TEST(ScheduleTable, FourStagesSixMicroBatchesHandWritten) {
  const ScheduleTable schedule = schedule_table(/*m=*/6, /*n=*/4);
  const ClockTable forward = {{0, 1, 2, 3, 4, 5, _, _, _},
                              {_, 0, 1, 2, 3, 4, 5, _, _},
                              {_, _, 0, 1, 2, 3, 4, 5, _},
                              {_, _, _, 0, 1, 2, 3, 4, 5}};
  const ClockTable backward = {{_, _, _, 5, 4, 3, 2, 1, 0},
                               {_, _, 5, 4, 3, 2, 1, 0, _},
                               {_, 5, 4, 3, 2, 1, 0, _, _},
                               {5, 4, 3, 2, 1, 0, _, _, _}};
  EXPECT_EQ(schedule.forward, forward);
  EXPECT_EQ(schedule.backward, backward);
  EXPECT_EQ(schedule.total_slots(), 72);
  EXPECT_EQ(schedule.idle_slots(), 24);
  EXPECT_NEAR(schedule.bubble_ratio(), 1.0 / 3.0, 1e-12);  // 33.3%
}

TEST(ScheduleTable, BubbleShrinksWithMoreMicroBatches) {
  // S = 4: (S - 1) / (M + S - 1) = 3/7, 3/11, 3/19, 3/35.
  const std::vector<std::pair<int, double>> expected_percent = {
      {4, 42.9}, {8, 27.3}, {16, 15.8}, {32, 8.6}};
  for (const auto& [m, percent] : expected_percent) {
    const double ratio = schedule_table(m, 4).bubble_ratio();
    EXPECT_NEAR(std::round(ratio * 1000.0) / 10.0, percent, 1e-9) << "M=" << m;
    EXPECT_NEAR(ratio, 3.0 / (m + 3), 1e-12) << "M=" << m;
  }
  EXPECT_EQ(schedule_table(5, 1).bubble_ratio(), 0.0);  // one stage never waits
}

TEST(ScheduleTable, EveryTaskOnceAndBackwardAfterItsSuccessor) {
  for (int m = 1; m <= 6; ++m) {
    for (int n = 1; n <= 6; ++n) {
      const ScheduleTable s = schedule_table(m, n);
      ASSERT_EQ(static_cast<int>(s.forward.size()), n);
      EXPECT_EQ(s.idle_slots(), 2 * (s.total_slots() / 2 - m * n));
      for (int j = 0; j < n; ++j) {
        ASSERT_EQ(static_cast<int>(s.forward[j].size()), m + n - 1);
        for (int k = 0; k < m + n - 1; ++k) {
          // Forward: stage j starts micro-batch i at tick i + j; backward mirrors it.
          const int i = k - j;
          EXPECT_EQ(s.forward[j][k], i >= 0 && i < m ? i : kIdle) << m << "x" << n;
          EXPECT_EQ(s.backward[j][m + n - 2 - k], s.forward[j][k]) << m << "x" << n;
        }
      }
    }
  }
}

TEST(ScheduleTable, RejectsCyclesThatDoNotFit) {
  EXPECT_THROW(clock_table({{{0, 2}}}, 2), std::invalid_argument);
  EXPECT_THROW(clock_table({{{0, 1}, {1, 1}}}, 2), std::invalid_argument);
  EXPECT_THROW(schedule_table(0, 4), std::invalid_argument);
}

TEST(ScheduleTable, TextTableAndGanttChartLiteral) {
  const ScheduleTable s = schedule_table(/*m=*/3, /*n=*/2);
  EXPECT_EQ(format_clock_table(s.forward),
            "tick     0  1  2  3\n"
            "stage 0  0  1  2  .\n"
            "stage 1  .  0  1  2\n");
  EXPECT_EQ(gantt_chart(s),
            "clock    0  1  2  3  4  5  6  7\n"
            "stage 0  F0 F1 F2 .  .  B2 B1 B0\n"
            "stage 1  .  F0 F1 F2 B2 B1 B0 .\n");
  // Two-digit micro-batches widen every column.
  const std::string wide = gantt_chart(schedule_table(11, 1));
  EXPECT_EQ(wide.substr(0, wide.find('\n')),
            "clock    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20  21");
}

}  // namespace
}  // namespace harness::pipeline
