// The zero-bubble schedules (Qi et al., ICLR 2024) as data: ZB-H1 ("zb1p") and ZB-V ("zbv")
// against hand-checked tables, their in-flight bounds against the paper's (1F1B's memory), their
// bubbles against the paper's formulas on the simulator's clock, the validator's rules for W
// passes, and the send/receive plans' deadlock proof for P <= 8 and M <= 16.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "harness/pipeline/p2p_plan.h"
#include "harness/pipeline/training_schedule.h"

#include "test_support.h"

namespace harness::pipeline {
namespace {

using testing::error_of;

constexpr ActionTicks kPaperUnits{1, 1, 1};  // F, B and W alike: a whole backward is two

int max_peak(const Timeline& timeline) {
  return *std::max_element(timeline.peak_in_flight.begin(), timeline.peak_in_flight.end());
}

TEST(ZeroBubbleSchedule, Zb1pTwoDevicesFourMicroBatchesLiteral) {
  // 1F1B's forwards and B passes; device 1 lets one W wait, into the time it would idle at the end.
  const TrainingSchedule schedule = zb1p_schedule(4, 2);
  EXPECT_EQ(schedule.name, "zb1p");
  EXPECT_TRUE(schedule.split_backward);
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3\n"
            "device 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3\n");
  const Timeline timeline = simulate(schedule, kPaperUnits);
  EXPECT_EQ(format_timeline(timeline),
            "clock     0  1  2  3  4  5  6  7  8  9  10 11 12\n"
            "device 0  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3\n"
            "device 1  .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3\n");
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{2, 2}));
  EXPECT_EQ(schedule.in_flight_bound, 2);  // 1F1B's

  // 1F1B on the same clock: the whole backward takes B + W = 2 ticks.
  const Timeline one_f_one_b = simulate(one_f_one_b_schedule(4, 2), kPaperUnits);
  EXPECT_EQ(format_timeline(one_f_one_b),
            "clock     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14\n"
            "device 0  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3\n"
            "device 1  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .\n");
  EXPECT_DOUBLE_EQ(one_f_one_b.bubble, 1.0 / 5.0);  // (P - 1) / (M + P - 1)
  EXPECT_DOUBLE_EQ(timeline.bubble, 1.0 / 13.0);    // (P - 1) / (3 M + P - 1)
  EXPECT_LE(timeline.bubble, 0.4 * one_f_one_b.bubble);
}

TEST(ZeroBubbleSchedule, Zb1pFourDevicesEightMicroBatchesLiteral) {
  const TrainingSchedule schedule = zb1p_schedule(8, 4);
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7\n"
            "device 1: F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7\n"
            "device 2: F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7\n"
            "device 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7\n");
  const Timeline timeline = simulate(schedule, kPaperUnits);
  EXPECT_EQ(timeline.ticks, 27);
  EXPECT_DOUBLE_EQ(timeline.bubble, 3.0 / 27.0);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{4, 4, 4, 4}));
}

TEST(ZeroBubbleSchedule, Zb1pBubbleIsThePapersAndItsMemoryIsOneFOneBsEverywhere) {
  for (int P = 1; P <= 8; ++P) {
    for (int M = 1; M <= 16; ++M) {
      const TrainingSchedule schedule = zb1p_schedule(M, P);
      const Timeline zb = simulate(schedule, kPaperUnits);
      const Timeline base = simulate(one_f_one_b_schedule(M, P), kPaperUnits);
      const std::string at = "P=" + std::to_string(P) + " M=" + std::to_string(M);
      // The paper's makespans with T_F = T_B = T_W = 1: 1F1B 3 M + 3 (P - 1), ZB-H1 3 M + (P - 1)
      // once M >= P (fewer micro-batches leave less to hide the trip behind).
      EXPECT_EQ(base.ticks, 3 * M + 3 * (P - 1)) << at;
      if (M >= P) {
        EXPECT_EQ(zb.ticks, 3 * M + (P - 1)) << at;
      }
      EXPECT_LE(zb.ticks, base.ticks) << at;
      EXPECT_EQ(schedule.in_flight_bound, std::min(P, M)) << at;
      EXPECT_LE(max_peak(zb), max_peak(base)) << at;
    }
  }
}

TEST(ZeroBubbleSchedule, ZbvTwoDevicesFourMicroBatchesLiteral) {
  // Device 0 holds stages 0 and 3 (chunks .0 and .1), device 1 stages 1 and 2: the model goes down
  // the devices and back up, and the loss is on device 0 with the embedding.
  const TrainingSchedule schedule = zbv_schedule(4, 2);
  EXPECT_EQ(schedule.placement, StagePlacement::kV);
  EXPECT_EQ(schedule.stages(), 4);
  EXPECT_EQ((std::vector<int>{schedule.device_of(0), schedule.device_of(1), schedule.device_of(2),
                              schedule.device_of(3)}),
            (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B0.0 B1.1 W0.0 F3.0 B1.0 W1.1 F2.1 B2.1 W1.0 W2.1 B2.0 "
            "W2.0 F3.1 B3.1 W3.1 B3.0 W3.0\n"
            "device 1: F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 W0.1 F2.0 B1.1 B1.0 W0.0 F2.1 W1.1 F3.0 B2.1 B2.0 W1.0 F3.1 "
            "W2.1 W2.0 B3.1 B3.0 W3.1 W3.0\n");
  // Chunk .1 of device 0 is stage 3, the last: its B needs no gradient from anywhere.
  EXPECT_EQ(schedule.per_device[0][4], Action::backward(0, 3));
  const Timeline timeline = simulate(schedule, kPaperUnits);
  EXPECT_EQ(timeline.ticks, 25);
  EXPECT_EQ(timeline.idle_slots(), 2);  // device 1's first tick, device 0's tick 22
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{4, 4}));
  EXPECT_EQ(schedule.in_flight_bound, 4);  // 2 P half-stages: 1F1B's P stages
  // A chunk is half a stage: on the same clock 1F1B's actions take two ticks each.
  const Timeline base = simulate(one_f_one_b_schedule(4, 2), {2, 2, 2});
  EXPECT_DOUBLE_EQ(base.bubble, 0.2);
  EXPECT_DOUBLE_EQ(timeline.bubble, 0.04);
}

TEST(ZeroBubbleSchedule, ZbvFourDevicesEightMicroBatchesLiteral) {
  const TrainingSchedule schedule = zbv_schedule(8, 4);
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F2.1 B2.1 B0.0 W2.1 F3.1 "
            "B3.1 B1.0 W0.0 B2.0 F7.0 W3.1 F4.1 B3.0 B4.1 W1.0 W2.0 W3.0 F5.1 B5.1 W4.1 B4.0 W5.1 F6.1 B6.1 W4.0 "
            "W6.1 B5.0 W5.0 F7.1 B7.1 B6.0 W7.1 W6.0 B7.0 W7.0\n"
            "device 1: F0.0 F1.0 F2.0 F3.0 F4.0 F0.1 F5.0 F1.1 B0.1 W0.1 F2.1 B1.1 W1.1 B0.0 B2.1 F3.1 W0.0 B1.0 "
            "B3.1 B2.0 F6.0 W2.1 F4.1 B3.0 W1.0 F7.0 B4.1 W3.1 F5.1 W2.0 W3.0 B4.0 B5.1 F6.1 W4.1 W4.0 B6.1 B5.0 "
            "W5.1 F7.1 W6.1 B6.0 B7.1 W5.0 W6.0 W7.1 B7.0 W7.0\n"
            "device 2: F0.0 F1.0 F2.0 F0.1 F3.0 F1.1 F4.0 F2.1 B0.1 W0.1 F3.1 B0.0 B1.1 W0.0 B2.1 B1.0 F5.0 B2.0 "
            "B3.1 W1.1 F4.1 B3.0 W2.1 F6.0 W1.0 F5.1 B4.1 W2.0 F7.0 B4.0 W3.1 F6.1 B5.1 W3.0 W4.1 B5.0 B6.1 F7.1 "
            "W4.0 B6.0 W5.1 W5.0 B7.1 W6.1 W6.0 B7.0 W7.1 W7.0\n"
            "device 3: F0.0 F0.1 F1.0 F1.1 F2.0 F2.1 F3.0 F3.1 B0.1 B0.0 W0.1 F4.0 B1.1 B1.0 B2.1 B2.0 W0.0 F4.1 "
            "B3.1 B3.0 W1.1 F5.0 W1.0 F5.1 W2.1 F6.0 B4.1 B4.0 W2.0 F6.1 W3.1 F7.0 B5.1 B5.0 W3.0 F7.1 B6.1 B6.0 "
            "W4.1 W4.0 W5.1 W5.0 B7.1 B7.0 W6.1 W6.0 W7.1 W7.0\n");
  const Timeline timeline = simulate(schedule, kPaperUnits);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{8, 8, 8, 8}));
  EXPECT_LE(timeline.bubble, 0.25 * simulate(one_f_one_b_schedule(8, 4), {2, 2, 2}).bubble);
}

TEST(ZeroBubbleSchedule, ZbvHoldsOneFOneBsMemoryWithLessBubbleThanZb1pEverywhere) {
  for (int P = 1; P <= 8; ++P) {
    for (int M = 1; M <= 16; ++M) {
      const TrainingSchedule schedule = zbv_schedule(M, P);
      const Timeline zb = simulate(schedule, kPaperUnits);
      const Timeline base = simulate(one_f_one_b_schedule(M, P), {2, 2, 2});
      const std::string at = "P=" + std::to_string(P) + " M=" + std::to_string(M);
      EXPECT_EQ(schedule.in_flight_bound, std::min(2 * P, 2 * M)) << at;
      // Half-stage activations: at most 1F1B's whole ones, counted twice.
      EXPECT_LE(max_peak(zb), 2 * max_peak(simulate_unit_time(one_f_one_b_schedule(M, P)))) << at;
      if (M >= P) {
        EXPECT_LE(zb.bubble, 0.4 * base.bubble) << at;
        EXPECT_LT(zb.bubble, simulate(zb1p_schedule(M, P), {2, 2, 2}).bubble + 1e-12) << at;
      }
    }
  }
}

TEST(ZeroBubbleSchedule, ZbvGivenEqualTicksKeepsThePapersOrder) {
  for (int P = 1; P <= 8; ++P) {
    for (int M = 1; M <= 16; ++M) {
      const auto unit = zbv_schedule(M, P).per_device;
      EXPECT_EQ(zbv_schedule(M, P, std::vector<ActionTicks>(2 * P, {1, 1, 1})).per_device, unit) << P << " " << M;
      EXPECT_EQ(zbv_schedule(M, P, std::vector<ActionTicks>(2 * P, {3, 3, 3})).per_device, unit) << P << " " << M;
    }
  }
}

// Stages 2 and 3 dearer than 0 and 1, as a block and a half and GPT-2's head make them: device 0
// (stages 0 and 3) has 4 x (6 + 9) = 60 ticks of work and device 1 4 x (6 + 8) = 56. The
// paper's order, made for equal ticks, takes 68 on this clock; the order made on it 61.
TEST(ZeroBubbleSchedule, ZbvOrderedOnItsStagesTicksLiteral) {
  const std::vector<ActionTicks> ticks = {{2, 2, 2}, {2, 2, 2}, {3, 3, 2}, {3, 4, 2}};
  const TrainingSchedule schedule = zbv_schedule(4, 2, ticks);
  EXPECT_EQ(format_actions(schedule),
            "device 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B0.0 B1.1 W0.0 F3.0 W1.1 B1.0 F2.1 B2.1 W1.0 F3.1 B3.1 "
            "B2.0 W2.1 W3.1 B3.0 W2.0 W3.0\n"
            "device 1: F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 W0.1 F2.0 W0.0 B1.1 B1.0 F2.1 W1.1 F3.0 W1.0 F3.1 B2.1 B2.0 "
            "W2.1 B3.1 B3.0 W2.0 W3.1 W3.0\n");
  const Timeline timeline = simulate(schedule, ticks);
  EXPECT_EQ(timeline.ticks, 61);
  EXPECT_EQ(simulate(zbv_schedule(4, 2), ticks).ticks, 68);
  EXPECT_EQ(timeline.idle_slots(), 2 * 61 - 60 - 56);
  EXPECT_LE(max_peak(timeline), schedule.in_flight_bound);
}

// Whatever the stages' ticks, the order is a valid ZB-V (every action once, on its stage's device,
// no deadlock, 1F1B's memory), its sends all meet their receives, and on its own clock it is never
// slower than the paper's order.
TEST(ZeroBubbleSchedule, ZbvOnAnyStageTicksIsValidAndNeverSlowerThanThePapersOrder) {
  uint32_t state = 12345;
  auto draw = [&state] {
    state = state * 1664525u + 1013904223u;
    return static_cast<int>(1 + (state >> 16) % 12);
  };
  int orders = 0, faster = 0;
  for (int P = 1; P <= 8; ++P) {
    for (int M : {1, 2, 3, 5, 8, 13, 16}) {
      for (int k = 0; k < 3; ++k) {
        std::vector<ActionTicks> ticks;
        for (int s = 0; s < 2 * P; ++s) ticks.push_back({draw(), draw(), draw()});
        const TrainingSchedule schedule = zbv_schedule(M, P, ticks);
        const std::string at = "P=" + std::to_string(P) + " M=" + std::to_string(M) + " draw " + std::to_string(k);
        const Timeline timeline = simulate(schedule, ticks);  // validates
        const int paper = simulate(zbv_schedule(M, P), ticks).ticks;
        EXPECT_LE(timeline.ticks, paper) << at;
        faster += timeline.ticks < paper;
        EXPECT_LE(max_peak(timeline), std::min(2 * P, 2 * M)) << at;
        validate_p2p_plan(make_p2p_plan(schedule));
        ++orders;
      }
    }
  }
  EXPECT_EQ(orders, 168);
  EXPECT_GT(faster, 0);  // the ticks change the order somewhere
}

TEST(ZeroBubbleSchedule, ZbvStageTicksAreCheckedAndNamed) {
  EXPECT_EQ(error_of([] { zbv_schedule(4, 2, {{1, 1, 1}}); }),
            "zbv_schedule: 1 stages' ticks given for 4 stages");
  EXPECT_EQ(error_of([] { zbv_schedule(4, 2, {{1, 1, 1}, {1, 0, 1}, {1, 1, 1}, {1, 1, 1}}); }),
            "zbv_schedule: stage 1 takes F 1, B 0, W 1 ticks; each needs at least one");
  EXPECT_EQ(error_of([] { simulate(zb1p_schedule(2, 2), std::vector<ActionTicks>{{1, 1, 1}}); }),
            "simulate: 1 stages' ticks given for 2 stages");
}

TEST(ZeroBubbleSchedule, SendReceivePlansMeetEverySendUpToEightStagesSixteenMicroBatches) {
  int plans = 0;
  for (int P = 1; P <= 8; ++P) {
    for (int M = 1; M <= 16; ++M) {
      for (const TrainingSchedule& schedule : {zb1p_schedule(M, P), zbv_schedule(M, P)}) {
        const P2PPlan plan = make_p2p_plan(schedule);
        validate_p2p_plan(plan);
        for (size_t d = 0; d < plan.per_device.size(); ++d) {
          for (const P2PStep& step : plan.per_device[d]) {
            for (const P2POp& op : step.exchange) {
              EXPECT_NE(static_cast<size_t>(op.peer), d) << "a message to its own device: " << p2p_op_label(op);
            }
          }
        }
        ++plans;
      }
    }
  }
  EXPECT_EQ(plans, 256);
}

TEST(ZeroBubbleSchedule, ZbvLastDeviceExchangesNothingBetweenItsTwoChunks) {
  const P2PPlan plan = make_p2p_plan(zbv_schedule(2, 2));
  for (const auto& steps : plan.per_device) {
    for (const P2PStep& step : steps) {
      for (const P2POp& op : step.exchange) {
        EXPECT_FALSE(op.message.kind == P2PMessage::Kind::kActivation && op.message.from_stage == 1)
            << p2p_op_label(op);
        EXPECT_FALSE(op.message.kind == P2PMessage::Kind::kGradient && op.message.from_stage == 2)
            << p2p_op_label(op);
      }
    }
  }
  EXPECT_EQ(format_p2p_plan(plan).find("s1->s2"), std::string::npos);
}

TEST(ZeroBubbleSchedule, ValidatorRulesForWeightPasses) {
  TrainingSchedule schedule = zb1p_schedule(2, 2);
  // A W before its B waits forever.
  TrainingSchedule early = schedule;
  early.per_device[1] = {Action::forward(0, 1), Action::weight(0, 1), Action::backward(0, 1),
                         Action::forward(1, 1), Action::backward(1, 1), Action::weight(1, 1)};
  EXPECT_NE(error_of([&] { validate_schedule(early); })
                .find("device 1 waits at action 1 (weight-gradient pass (W) of micro-batch 0 on stage 1) for the "
                      "input-gradient backward (B) of micro-batch 0 on stage 1"),
            std::string::npos)
      << error_of([&] { validate_schedule(early); });
  // A missing W is named.
  TrainingSchedule missing = schedule;
  missing.per_device[0].pop_back();
  EXPECT_NE(error_of([&] { validate_schedule(missing); })
                .find("device 0 never runs the weight-gradient pass (W) of micro-batch 1 on stage 0"),
            std::string::npos);
  // W passes in a schedule whose backward is whole are refused.
  TrainingSchedule whole = schedule;
  whole.split_backward = false;
  EXPECT_NE(error_of([&] { validate_schedule(whole); }).find("a W pass in a schedule whose backward is not split"),
            std::string::npos);
  // Held until the W: delaying every W to the end exceeds 1F1B's bound.
  TrainingSchedule hoarding = zb1p_schedule(4, 2);
  for (auto& actions : hoarding.per_device) {
    std::stable_partition(actions.begin(), actions.end(),
                          [](const Action& a) { return a.kind != Action::Kind::kWeight; });
  }
  EXPECT_NE(error_of([&] { validate_schedule(hoarding); })
                .find("activations forwarded and not yet through their W pass, above the schedule's "
                      "in_flight_bound 2"),
            std::string::npos);
  // A stage on the wrong side of the V.
  TrainingSchedule misplaced = zbv_schedule(1, 2);
  for (auto& actions : misplaced.per_device) {
    for (Action& a : actions) a.stage = (a.stage + 2) % 4;
  }
  EXPECT_NE(error_of([&] { validate_schedule(misplaced); }).find("belongs to device"), std::string::npos);
}

TEST(ZeroBubbleSchedule, FlagValuesAndChunks) {
  EXPECT_EQ(parse_schedule_kind("zb1p"), ScheduleKind::kZb1p);
  EXPECT_EQ(parse_schedule_kind("zbv"), ScheduleKind::kZbv);
  EXPECT_EQ(to_string(ScheduleKind::kZbv), "zbv");
  EXPECT_TRUE(splits_backward(ScheduleKind::kZb1p));
  EXPECT_FALSE(splits_backward(ScheduleKind::kOneFOneB));
  EXPECT_EQ(chunks_per_device(ScheduleKind::kZbv, 1), 2);
  EXPECT_EQ(chunks_per_device(ScheduleKind::kInterleaved, 3), 3);
  EXPECT_EQ(error_of([] { parse_schedule_kind("zb2p"); }),
            "--pipeline_schedule must be gpipe, 1f1b, interleaved, zb1p or zbv, got 'zb2p'");
  EXPECT_EQ(error_of([] { check_schedule_kind(ScheduleKind::kZb1p, 2); }),
            "--virtual_stages 2 needs --pipeline_schedule interleaved (got zb1p); gpipe, 1f1b and zb1p run one "
            "stage per device");
  EXPECT_NO_THROW(check_schedule_kind(ScheduleKind::kZbv, 2));
  EXPECT_EQ(error_of([] { check_schedule_kind(ScheduleKind::kZbv, 3); }),
            "--virtual_stages 3 does not fit --pipeline_schedule zbv, which runs two chunks per device in a V (give "
            "1 or 2)");
  EXPECT_EQ(error_of([] { simulate(zb1p_schedule(2, 2), {1, 0, 1}); }), "simulate: every action takes a tick at least, got F 1, B 0, W 1");
}

}  // namespace
}  // namespace harness::pipeline
