// The sends and receives of pipeline stages as processes, against literal tables, and the
// rendezvous check over every schedule for P <= 8, V <= 4, M <= 16; posted one by one, 1F1B's
// crossing exchanges deadlock, receives posted only when due deadlock GPipe over chunks, and the
// check says which device waits for what; pairs posted in different orders are refused.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "harness/pipeline/p2p_plan.h"
#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {
namespace {

// Device 1's receive of micro-batch 1 is posted before B0: device 0 has sent it by then.
TEST(P2PPlan, OneFOneBOnTwoStagesBatchesEachSendWithTheReceivesDueByThen) {
  const P2PPlan plan = make_p2p_plan(one_f_one_b_schedule(4, 2));
  EXPECT_EQ(format_p2p_plan(plan),
            "device 0: F0 [send act 0 s0->s1 to 1] F1 [send act 1 s0->s1 to 1, recv grad 0 s1->s0 from 1] B0 F2 "
            "[send act 2 s0->s1 to 1, recv grad 1 s1->s0 from 1] B1 F3 [send act 3 s0->s1 to 1, recv grad 2 s1->s0 "
            "from 1] B2 [recv grad 3 s1->s0 from 1] B3\n"
            "device 1: [recv act 0 s0->s1 from 0] F0 [recv act 1 s0->s1 from 0] B0 [send grad 0 s1->s0 to 0] F1 B1 "
            "[send grad 1 s1->s0 to 0, recv act 2 s0->s1 from 0] F2 B2 [send grad 2 s1->s0 to 0, recv act 3 s0->s1 "
            "from 0] F3 B3 [send grad 3 s1->s0 to 0]\n");
  validate_p2p_plan(plan);
}

TEST(P2PPlan, GPipeOnThreeStagesPassesEachTensorAlong) {
  const P2PPlan plan = make_p2p_plan(gpipe_schedule(2, 3));
  EXPECT_EQ(format_p2p_plan(plan),
            "device 0: F0 [send act 0 s0->s1 to 1] F1 [send act 1 s0->s1 to 1, recv grad 1 s1->s0 from 1] B1 "
            "[recv grad 0 s1->s0 from 1] B0\n"
            "device 1: [recv act 0 s0->s1 from 0] F0 [send act 0 s1->s2 to 2, recv act 1 s0->s1 from 0] F1 "
            "[send act 1 s1->s2 to 2, recv grad 1 s2->s1 from 2] B1 [send grad 1 s1->s0 to 0, recv grad 0 s2->s1 "
            "from 2] B0 [send grad 0 s1->s0 to 0]\n"
            "device 2: [recv act 0 s1->s2 from 1] F0 [recv act 1 s1->s2 from 1] F1 B1 [send grad 1 s2->s1 to 1] B0 "
            "[send grad 0 s2->s1 to 1]\n");
  validate_p2p_plan(plan);
}

// Interleaving: chunk c of device d is stage c * D + d, so the last stage's activation wraps from
// device D - 1 back to device 0 and every chunk boundary crosses devices.
TEST(P2PPlan, InterleavedWrapsFromTheLastDeviceToTheFirst) {
  const P2PPlan plan = make_p2p_plan(interleaved_schedule(2, 2, 2));
  const std::string text = format_p2p_plan(plan);
  EXPECT_NE(text.find("send act 0 s1->s2 to 0"), std::string::npos) << text;
  EXPECT_NE(text.find("recv act 0 s1->s2 from 1"), std::string::npos) << text;
  EXPECT_NE(text.find("send grad 0 s2->s1 to 1"), std::string::npos) << text;
  validate_p2p_plan(plan);
}

TEST(P2PPlan, OneDeviceExchangesNothing) {
  const P2PPlan plan = make_p2p_plan(gpipe_schedule(3, 1, 4));
  for (const P2PStep& step : plan.per_device[0]) EXPECT_FALSE(step.is_exchange());
  validate_p2p_plan(plan);
}

TEST(P2PPlan, EveryScheduleUpToEightStagesFourChunksSixteenMicroBatchesMeetsEverySend) {
  int plans = 0;
  for (int D = 1; D <= 8; ++D) {
    for (int M = 1; M <= 16; ++M) {
      validate_p2p_plan(make_p2p_plan(gpipe_schedule(M, D)));
      validate_p2p_plan(make_p2p_plan(one_f_one_b_schedule(M, D)));
      plans += 2;
      for (int V = 1; V <= 4; ++V) {
        validate_p2p_plan(make_p2p_plan(gpipe_schedule(M, D, V)));
        ++plans;
        if (M % D == 0) {
          validate_p2p_plan(make_p2p_plan(interleaved_schedule(M, D, V)));
          ++plans;
        }
      }
    }
  }
  EXPECT_GT(plans, 800);
}

TEST(P2PPlan, PostedOneByOneOneFOneBDeadlocksAndTheCheckSaysWhere) {
  const P2PPlan plan = make_p2p_plan(one_f_one_b_schedule(4, 2), P2PGrouping::kOneByOne);
  try {
    validate_p2p_plan(plan);
    FAIL() << "expected a deadlock";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("validate_p2p_plan(1f1b, M=4, D=2, V=1): the sends and receives deadlock"),
              std::string::npos) << what;
    EXPECT_NE(what.find("device 0 waits at step 7 [send act 2 s0->s1 to 1] for send act 2 s0->s1 to 1"),
              std::string::npos) << what;
    EXPECT_NE(what.find("device 1 waits at step 7 [send grad 1 s1->s0 to 0] for send grad 1 s1->s0 to 0"),
              std::string::npos) << what;
  }
  // GPipe's exchanges never cross: one by one is fine there.
  validate_p2p_plan(make_p2p_plan(gpipe_schedule(4, 3), P2PGrouping::kOneByOne));
}

// With every receive posted right before the action that needs it, device 0 of GPipe over two
// chunks sends all its activations before it takes any back, while device 1 waits to hand back its
// first: the rendezvous deadlocks. The plan posts that receive when its sender has run.
TEST(P2PPlan, ReceivesPostedOnlyWhenDueDeadlockGPipeOverChunks) {
  const TrainingSchedule schedule = gpipe_schedule(4, 2, 2);
  P2PPlan late;
  late.schedule = schedule;
  late.per_device.resize(2);
  for (int d = 0; d < 2; ++d) {
    for (const Action& action : schedule.per_device[d]) {
      const bool forward = action.kind == Action::Kind::kForward;
      const int S = schedule.stages();
      const bool receives = forward ? action.stage > 0 : action.stage < S - 1;
      if (receives) {
        P2PStep step;
        step.exchange = {{P2POp::Kind::kRecv, 1 - d,
                          {forward ? P2PMessage::Kind::kActivation : P2PMessage::Kind::kGradient, action.micro_batch,
                           forward ? action.stage - 1 : action.stage + 1}}};
        late.per_device[d].push_back(step);
      }
      P2PStep compute;
      compute.action = action;
      late.per_device[d].push_back(compute);
      const bool sends = forward ? action.stage < S - 1 : action.stage > 0;
      if (sends) {
        P2PStep step;
        step.exchange = {{P2POp::Kind::kSend, 1 - d,
                          {forward ? P2PMessage::Kind::kActivation : P2PMessage::Kind::kGradient, action.micro_batch,
                           action.stage}}};
        late.per_device[d].push_back(step);
      }
    }
  }
  try {
    validate_p2p_plan(late);
    FAIL() << "expected a deadlock";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
  }
  validate_p2p_plan(make_p2p_plan(schedule));
}

TEST(P2PPlan, PairsPostedInDifferentOrdersAreRefused) {
  P2PPlan plan = make_p2p_plan(gpipe_schedule(2, 2));
  // Device 1 receives micro-batch 1's activation before micro-batch 0's.
  std::vector<P2PStep*> receives;
  for (P2PStep& step : plan.per_device[1]) {
    for (P2POp& op : step.exchange) {
      if (op.kind == P2POp::Kind::kRecv) receives.push_back(&step);
    }
  }
  ASSERT_GE(receives.size(), 2u);
  std::swap(receives[0]->exchange, receives[1]->exchange);
  try {
    validate_p2p_plan(plan);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("device 0's message 0 to device 1 is act 0 s0->s1 but device 1 receives "
                                         "act 1 s0->s1 there"),
              std::string::npos) << e.what();
  }
}

TEST(P2PPlan, AMessageWithoutItsReceiveIsNamed) {
  P2PPlan plan = make_p2p_plan(one_f_one_b_schedule(2, 2));
  auto& device1 = plan.per_device[1];
  ASSERT_TRUE(device1.front().is_exchange());
  device1.erase(device1.begin());  // device 1 never receives micro-batch 0's activation
  try {
    validate_p2p_plan(plan);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("message act 0 s0->s1 is sent 1 times and received 0 times"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace harness::pipeline
