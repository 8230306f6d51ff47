// GPipe, 1F1B and interleaved 1F1B action lists, their unit-time timelines and the validator,
// against hand-written tables; GPipe also against the clock schedule Pipe executes (schedule.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "harness/pipeline/schedule.h"
#include "harness/pipeline/training_schedule.h"

#include "test_support.h"

namespace harness::pipeline {
namespace {

using testing::error_of;

Action F(int micro_batch, int stage) { return Action::forward(micro_batch, stage); }
Action B(int micro_batch, int stage) { return Action::backward(micro_batch, stage); }

// The timeline as labels, "." idle: comparable with the clock tables below.
std::vector<std::vector<std::string>> timeline_cells(const Timeline& timeline) {
  std::vector<std::vector<std::string>> cells;
  const int devices = static_cast<int>(timeline.slots.size());
  for (const auto& row : timeline.slots) {
    cells.emplace_back();
    for (const auto& slot : row) {
      cells.back().push_back(slot ? action_label(*slot, devices, timeline.virtual_stages) : ".");
    }
  }
  return cells;
}

// gantt_chart's cells: stage j's forward clock row, then its backward clock row.
std::vector<std::vector<std::string>> gantt_cells(const ScheduleTable& schedule) {
  std::vector<std::vector<std::string>> cells;
  for (size_t j = 0; j < schedule.forward.size(); ++j) {
    cells.emplace_back();
    for (int i : schedule.forward[j]) {
      cells.back().push_back(i == kIdle ? "." : "F" + std::to_string(i));
    }
    for (int i : schedule.backward[j]) {
      cells.back().push_back(i == kIdle ? "." : "B" + std::to_string(i));
    }
  }
  return cells;
}

TEST(GPipeTrainingSchedule, ThreeMicroBatchesTwoDevicesLiteral) {
  const TrainingSchedule schedule = gpipe_schedule(/*micro_batches=*/3, /*devices=*/2);
  EXPECT_EQ(schedule.name, "gpipe");
  EXPECT_EQ(schedule.per_device[0],
            (std::vector<Action>{F(0, 0), F(1, 0), F(2, 0), B(2, 0), B(1, 0), B(0, 0)}));
  EXPECT_EQ(schedule.per_device[1],
            (std::vector<Action>{F(0, 1), F(1, 1), F(2, 1), B(2, 1), B(1, 1), B(0, 1)}));
  EXPECT_EQ(schedule.in_flight_bound, 3);

  const Timeline timeline = simulate_unit_time(schedule);
  EXPECT_EQ(format_timeline(timeline),
            "clock     0  1  2  3  4  5  6  7\n"
            "device 0  F0 F1 F2 .  .  B2 B1 B0\n"
            "device 1  .  F0 F1 F2 B2 B1 B0 .\n");
  // The same cells as the GPipe Gantt chart of the clock schedule Pipe runs.
  EXPECT_EQ(gantt_chart(schedule_table(3, 2)),
            "clock    0  1  2  3  4  5  6  7\n"
            "stage 0  F0 F1 F2 .  .  B2 B1 B0\n"
            "stage 1  .  F0 F1 F2 B2 B1 B0 .\n");
  EXPECT_EQ(timeline_cells(timeline), gantt_cells(schedule_table(3, 2)));
  EXPECT_EQ(timeline.ticks, 8);
  EXPECT_EQ(timeline.idle_slots(), 4);
  EXPECT_DOUBLE_EQ(timeline.bubble, 0.25);  // (D - 1) / (M + D - 1) = 1/4
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{3, 3}));
}

TEST(GPipeTrainingSchedule, UnitTimeEqualsClockScheduleEverywhere) {
  for (int m = 1; m <= 6; ++m) {
    for (int n = 1; n <= 6; ++n) {
      const ScheduleTable clock = schedule_table(m, n);
      const Timeline timeline = simulate_unit_time(gpipe_schedule(m, n));
      EXPECT_EQ(timeline_cells(timeline), gantt_cells(clock)) << "M=" << m << " D=" << n;
      EXPECT_EQ(timeline.ticks, 2 * (m + n - 1)) << "M=" << m << " D=" << n;
      EXPECT_DOUBLE_EQ(timeline.bubble, clock.bubble_ratio()) << "M=" << m << " D=" << n;
      EXPECT_EQ(timeline.peak_in_flight, std::vector<int>(static_cast<size_t>(n), m));
    }
  }
}

TEST(GPipeTrainingSchedule, OverVirtualStagesLiteral) {
  // The executor's fallback when interleaving cannot take a batch: GPipe over D * V stages placed
  // round-robin, chunk by chunk.
  const TrainingSchedule schedule = gpipe_schedule(/*micro_batches=*/2, /*devices=*/2, /*virtual_stages=*/2);
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0.0 F1.0 F0.1 F1.1 B1.1 B0.1 B1.0 B0.0\n"
            "device 1: F0.0 F1.0 F0.1 F1.1 B1.1 B0.1 B1.0 B0.0\n");
  EXPECT_EQ(schedule.per_device[1],
            (std::vector<Action>{F(0, 1), F(1, 1), F(0, 3), F(1, 3), B(1, 3), B(0, 3), B(1, 1), B(0, 1)}));
  EXPECT_EQ(schedule.in_flight_bound, 4);
  const Timeline timeline = simulate_unit_time(schedule);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{4, 4}));
  for (int m = 1; m <= 5; ++m) {
    for (int d = 1; d <= 4; ++d) {
      for (int v = 1; v <= 3; ++v) EXPECT_NO_THROW(validate_schedule(gpipe_schedule(m, d, v))) << m << d << v;
    }
  }
  EXPECT_EQ(format_actions(gpipe_schedule(3, 2, 1)), format_actions(gpipe_schedule(3, 2)));
}

TEST(OneFOneBSchedule, FourDevicesEightMicroBatchesLiteral) {
  const TrainingSchedule schedule = one_f_one_b_schedule(/*micro_batches=*/8, /*devices=*/4);
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7\n"
            "device 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7\n"
            "device 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7\n"
            "device 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7\n");
  EXPECT_EQ(schedule.per_device[2][2], B(0, 2));  // labels aside: device d runs stage d
  EXPECT_EQ(schedule.in_flight_bound, 4);

  const Timeline timeline = simulate_unit_time(schedule);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{4, 3, 2, 1}));
  const Timeline gpipe = simulate_unit_time(gpipe_schedule(8, 4));
  EXPECT_EQ(gpipe.peak_in_flight, (std::vector<int>{8, 8, 8, 8}));
  EXPECT_EQ(timeline.ticks, 22);
  EXPECT_EQ(gpipe.ticks, 22);
  EXPECT_EQ(timeline.idle_slots(), 24);
  EXPECT_DOUBLE_EQ(timeline.bubble, 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(timeline.bubble, schedule_table(8, 4).bubble_ratio());
}

TEST(OneFOneBSchedule, TwoDevicesFourMicroBatchesTimelineLiteral) {
  // By hand: device 0 waits at tick 2 for B0 from device 1, and at tick 8 for B3; device 1 waits
  // for its first input and has nothing left at the end.
  const Timeline timeline = simulate_unit_time(one_f_one_b_schedule(4, 2));
  EXPECT_EQ(format_timeline(timeline),
            "clock     0  1  2  3  4  5  6  7  8  9\n"
            "device 0  F0 F1 .  B0 F2 B1 F3 B2 .  B3\n"
            "device 1  .  F0 B0 F1 B1 F2 B2 F3 B3 .\n");
  EXPECT_DOUBLE_EQ(timeline.bubble, 0.2);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{2, 1}));
}

TEST(OneFOneBSchedule, SameBubbleAsGPipeLowerPeakEverywhere) {
  for (int m = 1; m <= 8; ++m) {
    for (int n = 1; n <= 5; ++n) {
      const TrainingSchedule schedule = one_f_one_b_schedule(m, n);
      const Timeline timeline = simulate_unit_time(schedule);
      EXPECT_EQ(timeline.ticks, 2 * (m + n - 1)) << "M=" << m << " D=" << n;
      EXPECT_DOUBLE_EQ(timeline.bubble, schedule_table(m, n).bubble_ratio())
          << "M=" << m << " D=" << n;
      for (int d = 0; d < n; ++d) {
        EXPECT_EQ(timeline.peak_in_flight[static_cast<size_t>(d)], std::min(n - d, m))
            << "M=" << m << " D=" << n << " device " << d;
      }
    }
  }
}

TEST(InterleavedSchedule, TwoDevicesTwoChunksFourMicroBatchesLiteral) {
  // Megatron's order, worked by hand: steps k = 0..7 are micro-batches 0 1 0 1 2 3 2 3 through
  // chunks 0 0 1 1 0 0 1 1 (backwards: chunks 1 1 0 0 1 1 0 0). Device 0 warms up with
  // 2 (D - 1) + (V - 1) D = 4 forwards, device 1 with 2. Chunk c of device d is stage 2c + d.
  const TrainingSchedule schedule = interleaved_schedule(4, /*devices=*/2, /*virtual_stages=*/2);
  EXPECT_EQ(schedule.per_device[0],
            (std::vector<Action>{F(0, 0), F(1, 0), F(0, 2), F(1, 2), F(2, 0), B(0, 2),  //
                                 F(3, 0), B(1, 2), F(2, 2), B(0, 0), F(3, 2), B(1, 0),  //
                                 B(2, 2), B(3, 2), B(2, 0), B(3, 0)}));
  EXPECT_EQ(schedule.per_device[1],
            (std::vector<Action>{F(0, 1), F(1, 1), F(0, 3), B(0, 3), F(1, 3), B(1, 3),  //
                                 F(2, 1), B(0, 1), F(3, 1), B(1, 1), F(2, 3), B(2, 3),  //
                                 F(3, 3), B(3, 3), B(2, 1), B(3, 1)}));
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 "
            "F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0\n"
            "device 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 "
            "F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0\n");
  EXPECT_NO_THROW(validate_schedule(schedule));
  EXPECT_EQ(schedule.in_flight_bound, 5);  // (V + 1) D - 1

  // Simulated by hand, one tick per chunk-step: device 1 idles at tick 0 waiting for F0.0; device
  // 0 idles at ticks 12 and 14 waiting for B2.1 and B3.1 from device 1, and device 1 at tick 17
  // has finished. 4 idle of 2 x 18 slots = 1/9 = (D - 1) / (V M + D - 1).
  const Timeline timeline = simulate_unit_time(schedule);
  EXPECT_EQ(format_timeline(timeline),
            "clock     0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17\n"
            "device 0  F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 .    B2.1 .    B3.1 B2.0 B3.0\n"
            "device 1  .    F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0 .\n");
  EXPECT_EQ(timeline.ticks, 18);
  EXPECT_EQ(timeline.idle_slots(), 4);
  EXPECT_DOUBLE_EQ(timeline.bubble, 1.0 / 9.0);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{5, 3}));

  const Timeline one_f_one_b = simulate_unit_time(one_f_one_b_schedule(4, 2));
  EXPECT_DOUBLE_EQ(one_f_one_b.bubble, 1.0 / 5.0);
  EXPECT_LT(timeline.bubble, one_f_one_b.bubble);
}

TEST(InterleavedSchedule, FourDevicesBubblesAgainstOneFOneB) {
  // What the simulator gives for D = 4, M = 8: idle stays 2 (D - 1) ticks per device, in ticks V
  // times shorter, so the bubble is (D - 1) / (V M + D - 1); peaks are w_d + 1 = 2 (D - d - 1) +
  // (V - 1) D + 1 activations of one chunk each.
  struct Case {
    int virtual_stages;
    int ticks;
    double bubble;
    std::vector<int> peaks;
  };
  const std::vector<Case> cases = {
      {1, 22, 3.0 / 11.0, {7, 5, 3, 1}},
      {2, 38, 3.0 / 19.0, {11, 9, 7, 5}},
      {4, 70, 3.0 / 35.0, {19, 17, 15, 13}},
  };
  const double one_f_one_b = simulate_unit_time(one_f_one_b_schedule(8, 4)).bubble;
  for (const Case& c : cases) {
    const Timeline timeline = simulate_unit_time(interleaved_schedule(8, 4, c.virtual_stages));
    EXPECT_EQ(timeline.ticks, c.ticks) << "V=" << c.virtual_stages;
    EXPECT_DOUBLE_EQ(timeline.bubble, c.bubble) << "V=" << c.virtual_stages;
    EXPECT_EQ(timeline.peak_in_flight, c.peaks) << "V=" << c.virtual_stages;
    if (c.virtual_stages > 1) {
      EXPECT_LT(timeline.bubble, one_f_one_b) << "V=" << c.virtual_stages;
    }
  }
}

TEST(InterleavedSchedule, AsManyMicroBatchesAsDevicesIsAllWarmUp) {
  // Megatron core v0.7 runs every forward before any backward when M == D.
  const TrainingSchedule schedule = interleaved_schedule(2, 2, 2);
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0\n"
            "device 1: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0\n");
  EXPECT_EQ(schedule.in_flight_bound, 4);
  EXPECT_EQ(simulate_unit_time(schedule).peak_in_flight, (std::vector<int>{4, 4}));
}

TEST(InterleavedSchedule, ValidAndPeakMeetsBoundEverywhere) {
  for (int d = 1; d <= 4; ++d) {
    for (int m = d; m <= 12; m += d) {
      for (int v = 1; v <= 3; ++v) {
        const TrainingSchedule schedule = interleaved_schedule(m, d, v);
        const Timeline timeline = simulate_unit_time(schedule);  // validates
        EXPECT_EQ(timeline.peak_in_flight[0], schedule.in_flight_bound)
            << "M=" << m << " D=" << d << " V=" << v;
        EXPECT_LE(timeline.bubble, schedule_table(m, d).bubble_ratio() + 1e-12)
            << "M=" << m << " D=" << d << " V=" << v;
      }
    }
  }
}

TEST(ValidateSchedule, RejectsMissingBackward) {
  TrainingSchedule schedule = gpipe_schedule(3, 2);
  schedule.per_device[1].pop_back();  // B0 on stage 1
  EXPECT_EQ(error_of([&] { validate_schedule(schedule); }),
            "validate_schedule(gpipe, M=3, D=2, V=1): device 1 never runs the backward of "
            "micro-batch 0 on stage 1");
}

TEST(ValidateSchedule, RejectsDuplicatedForward) {
  TrainingSchedule schedule = gpipe_schedule(3, 2);
  auto& actions = schedule.per_device[0];
  actions.insert(actions.begin() + 2, F(1, 0));
  EXPECT_EQ(error_of([&] { validate_schedule(schedule); }),
            "validate_schedule(gpipe, M=3, D=2, V=1): device 0, action 2 (forward of micro-batch 1 "
            "on stage 0): already listed as action 1");
}

TEST(ValidateSchedule, RejectsActionOnWrongDevice) {
  // Stage 3 is chunk 1 of device 1, not of device 0.
  TrainingSchedule schedule = interleaved_schedule(4, 2, 2);
  schedule.per_device[0][2] = F(0, 3);
  EXPECT_EQ(error_of([&] { validate_schedule(schedule); }),
            "validate_schedule(interleaved, M=4, D=2, V=2): device 0, action 2 (forward of "
            "micro-batch 0 on stage 3): stage 3 belongs to device 1");
}

TEST(ValidateSchedule, RejectsOrderThatDeadlocks) {
  // The last stage lists B0 before F0: it can never start, and device 0 runs its forwards and
  // then waits for a gradient that never comes.
  TrainingSchedule schedule = gpipe_schedule(3, 2);
  schedule.per_device[1] = {B(0, 1), F(0, 1), F(1, 1), F(2, 1), B(2, 1), B(1, 1)};
  EXPECT_EQ(error_of([&] { validate_schedule(schedule); }),
            "validate_schedule(gpipe, M=3, D=2, V=1): deadlock at tick 3: "
            "device 0 waits at action 3 (backward of micro-batch 2 on stage 0) "
            "for the backward of micro-batch 2 on stage 1; "
            "device 1 waits at action 0 (backward of micro-batch 0 on stage 1) "
            "for the forward of micro-batch 0 on stage 1");
  EXPECT_THROW(simulate_unit_time(schedule), std::invalid_argument);
}

TEST(ValidateSchedule, RejectsExceededInFlightBound) {
  // GPipe's order is valid, but holds five micro-batches on device 0 by F4, beyond 1F1B's bound.
  TrainingSchedule schedule = gpipe_schedule(8, 4);
  schedule.name = "1f1b";
  schedule.in_flight_bound = one_f_one_b_schedule(8, 4).in_flight_bound;
  EXPECT_EQ(error_of([&] { validate_schedule(schedule); }),
            "validate_schedule(1f1b, M=8, D=4, V=1): device 0, action 4 (forward of micro-batch 4 "
            "on stage 0): 5 activations forwarded and not yet backwarded, above the schedule's "
            "in_flight_bound 4");

  TrainingSchedule tight = one_f_one_b_schedule(8, 4);
  tight.in_flight_bound = 3;
  EXPECT_EQ(error_of([&] { validate_schedule(tight); }),
            "validate_schedule(1f1b, M=8, D=4, V=1): device 0, action 3 (forward of micro-batch 3 "
            "on stage 0): 4 activations forwarded and not yet backwarded, above the schedule's "
            "in_flight_bound 3");
}

TEST(ValidateSchedule, RejectsOutOfRangeAndMissingDeviceLists) {
  TrainingSchedule schedule = gpipe_schedule(3, 2);
  schedule.per_device[1][1] = F(3, 1);
  EXPECT_EQ(error_of([&] { validate_schedule(schedule); }),
            "validate_schedule(gpipe, M=3, D=2, V=1): device 1, action 1 (forward of micro-batch 3 "
            "on stage 1): micro-batch outside [0, 3)");
  schedule = gpipe_schedule(3, 2);
  schedule.per_device.pop_back();
  EXPECT_EQ(error_of([&] { validate_schedule(schedule); }),
            "validate_schedule(gpipe, M=3, D=2, V=1): per_device has 1 lists, expected one per "
            "device (2)");
}

TEST(TrainingScheduleArguments, ErrorsNameTheValues) {
  EXPECT_EQ(error_of([] { gpipe_schedule(0, 4); }),
            "gpipe_schedule: need at least one micro-batch, device and virtual stage, got "
            "micro_batches=0, devices=4, virtual_stages=1");
  EXPECT_EQ(error_of([] { one_f_one_b_schedule(8, 0); }),
            "one_f_one_b_schedule: need at least one micro-batch, device and virtual stage, got "
            "micro_batches=8, devices=0, virtual_stages=1");
  EXPECT_EQ(error_of([] { interleaved_schedule(8, 4, 0); }),
            "interleaved_schedule: need at least one micro-batch, device and virtual stage, got "
            "micro_batches=8, devices=4, virtual_stages=0");
  EXPECT_EQ(error_of([] { interleaved_schedule(-1, 4, 2); }),
            "interleaved_schedule: need at least one micro-batch, device and virtual stage, got "
            "micro_batches=-1, devices=4, virtual_stages=2");
  EXPECT_EQ(error_of([] { interleaved_schedule(6, 4, 2); }),
            "interleaved_schedule: micro_batches=6 is not divisible by devices=4; micro-batches go "
            "through the chunks in groups of one per device");
}

}  // namespace
}  // namespace harness::pipeline
