// GPipe's step as the engine's forward and backward plans (what the Pipe runs), against literal
// plans, and run in unit time against the a5_2_1 clock tables of clock_cycles and
// backward_clock_cycles; a schedule that interleaves forwards and backwards is refused by name.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "harness/pipeline/gpipe_plan.h"
#include "harness/pipeline/schedule.h"
#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {
namespace {

TEST(GPipePlan, TwoPartitionsSplitIntoLiteralHalves) {
  const PlanHalves& halves = gpipe_plan_halves(/*m=*/2, /*n=*/2);
  EXPECT_EQ(format_p2p_plan(halves.forward),
            "device 0: F0 [send act 0 s0->s1 to 1] F1 [send act 1 s0->s1 to 1]\n"
            "device 1: [recv act 0 s0->s1 from 0] F0 [recv act 1 s0->s1 from 0] F1\n");
  EXPECT_EQ(format_p2p_plan(halves.backward),
            "device 0: [recv grad 1 s1->s0 from 1] B1 [recv grad 0 s1->s0 from 1] B0\n"
            "device 1: B1 [send grad 1 s1->s0 to 0] B0 [send grad 0 s1->s0 to 0]\n");
  EXPECT_EQ(halves.forward.schedule.per_device[1],
            (std::vector<Action>{Action::forward(0, 1), Action::forward(1, 1)}));
  EXPECT_EQ(halves.backward.schedule.name, "gpipe backwards");
}

// The middle partition's mixed groups of the whole plan ([send act 1 s1->s2, recv grad 1 s2->s1])
// go apart by message.
TEST(GPipePlan, ThreePartitionsSplitEachExchangeByMessage) {
  const PlanHalves& halves = gpipe_plan_halves(/*m=*/2, /*n=*/3);
  EXPECT_EQ(format_p2p_plan(halves.forward),
            "device 0: F0 [send act 0 s0->s1 to 1] F1 [send act 1 s0->s1 to 1]\n"
            "device 1: [recv act 0 s0->s1 from 0] F0 [send act 0 s1->s2 to 2, recv act 1 s0->s1 from 0] F1 "
            "[send act 1 s1->s2 to 2]\n"
            "device 2: [recv act 0 s1->s2 from 1] F0 [recv act 1 s1->s2 from 1] F1\n");
  EXPECT_EQ(format_p2p_plan(halves.backward),
            "device 0: [recv grad 1 s1->s0 from 1] B1 [recv grad 0 s1->s0 from 1] B0\n"
            "device 1: [recv grad 1 s2->s1 from 2] B1 [send grad 1 s1->s0 to 0, recv grad 0 s2->s1 from 2] B0 "
            "[send grad 0 s1->s0 to 0]\n"
            "device 2: B1 [send grad 1 s2->s1 to 1] B0 [send grad 0 s2->s1 to 1]\n");
  validate_p2p_plan(halves.forward);
  validate_p2p_plan(halves.backward);
}

// The a5_2_1 table (m = 3, n = 3) is what the forward half runs, tick by tick.
TEST(GPipePlan, a5_2_1_TheForwardHalfRunsTheSpecClockTable) {
  const std::vector<Cycle> expected = {{{0, 0}},
                                       {{1, 0}, {0, 1}},
                                       {{2, 0}, {1, 1}, {0, 2}},
                                       {{2, 1}, {1, 2}},
                                       {{2, 2}}};
  EXPECT_EQ(unit_time_cycles(gpipe_plan_halves(3, 3).forward), expected);
  const std::vector<Cycle> backward = {{{2, 2}},
                                       {{1, 2}, {2, 1}},
                                       {{0, 2}, {1, 1}, {2, 0}},
                                       {{0, 1}, {1, 0}},
                                       {{0, 0}}};
  EXPECT_EQ(unit_time_cycles(gpipe_plan_halves(3, 3).backward), backward);
}

TEST(GPipePlan, EveryShapeUpTo8x8RunsClockCyclesAndBackwardClockCycles) {
  for (int m = 1; m <= 8; ++m) {
    for (int n = 1; n <= 8; ++n) {
      const PlanHalves& halves = gpipe_plan_halves(m, n);
      EXPECT_EQ(unit_time_cycles(halves.forward), clock_cycles(m, n)) << "m=" << m << " n=" << n;
      EXPECT_EQ(unit_time_cycles(halves.backward), backward_clock_cycles(m, n)) << "m=" << m << " n=" << n;
      // Each partition's row of the clock table is its device's list of forwards.
      const ClockTable table = clock_table(clock_cycles(m, n), n);
      for (int j = 0; j < n; ++j) {
        std::vector<Action> row;
        for (int i : table[j]) {
          if (i != kIdle) row.push_back(Action::forward(i, j));
        }
        EXPECT_EQ(halves.forward.schedule.per_device[j], row) << "m=" << m << " n=" << n << " j=" << j;
      }
    }
  }
}

// The whole step in unit time: gantt_chart's ticks (m = 3, n = 2:
// stage 0 F0 F1 F2 . . B2 B1 B0, stage 1 . F0 F1 F2 B2 B1 B0 .).
TEST(GPipePlan, TheWholeStepInUnitTimeIsTheGanttChart) {
  const std::vector<Cycle> expected = {{{0, 0}}, {{1, 0}, {0, 1}}, {{2, 0}, {1, 1}}, {{2, 1}},
                                       {{2, 1}}, {{1, 1}, {2, 0}}, {{0, 1}, {1, 0}}, {{0, 0}}};
  EXPECT_EQ(unit_time_cycles(make_p2p_plan(gpipe_schedule(3, 2))), expected);
}

TEST(GPipePlan, RefusesASplitOfInterleavedForwardsAndBackwards) {
  try {
    split_at_first_backward(make_p2p_plan(one_f_one_b_schedule(4, 2)));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("(1f1b): device 0 runs F2 after a backward"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gpipe_plan_halves(0, 2), std::invalid_argument);
}

TEST(GPipePlan, UnitTimeNamesTheDevicesThatWait) {
  // Device 1 would run micro-batch 0's backward before its own forward.
  P2PPlan plan = gpipe_plan_halves(1, 2).forward;
  plan.per_device[1] = {P2PStep{Action::backward(0, 1), {}}, P2PStep{Action::forward(0, 1), {}}};
  try {
    unit_time_cycles(plan);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("device 1 at B0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace harness::pipeline
