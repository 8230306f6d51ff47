// A run's plan: its geometry, every rule its validation applies (the flags named), and the record
// a checkpoint's manifest keeps of it.
#include "harness/train/plan/plan.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;

void expect_refused(const Plan& plan, const std::string& message) {
  try {
    plan.validate();
    ADD_FAILURE() << "expected an error containing: " << message;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

Plan sized(int world, int tensor, int context, int pipeline) {
  Plan plan;
  plan.world_size = world;
  plan.tensor_parallel_size = tensor;
  plan.context_parallel_size = context;
  plan.pipeline_parallel_size = pipeline;
  return plan;
}

TEST(Plan, TheDataParallelSizeIsWhatTheWorldLeaves) {
  EXPECT_EQ(sized(16, 2, 2, 2).data_parallel_size(), 2);
  EXPECT_EQ(sized(16, 2, 2, 2).gradient_group_size(), 4);  // D x C
  EXPECT_EQ(sized(6, 4, 1, 1).data_parallel_size(), 0);    // refused by validate()
  const parallel::Layout layout = sized(8, 2, 1, 2).layout();
  EXPECT_EQ(layout.sizes_text(), "data 2 x tensor 2 x pipeline 2 = world 8");
  Plan v = sized(4, 1, 1, 2);
  v.pipeline.schedule = pipeline::ScheduleKind::kZbv;  // the loss on pipeline rank 0
  EXPECT_TRUE(v.layout().is_last_stage(0));
}

TEST(Plan, EveryRuleIsCheckedOnceNamingTheFlags) {
  Plan plan = sized(6, 4, 1, 1);
  expect_refused(plan, "--world_size 6 is not divisible by --tensor_parallel_size 4");
  plan = sized(4, 1, 1, 1);
  plan.sequence_parallel = true;
  expect_refused(plan, "--sequence_parallel splits the sequence over the tensor-parallel group");
  plan = sized(4, 1, 1, 1);
  plan.zero.stage = 4;
  expect_refused(plan, "--zero_stage 4: expected 0, 1, 2 or 3");
  plan.zero.stage = 3;
  plan.zero.prefetch = -1;
  expect_refused(plan, "--zero_prefetch -1 must be >= 0");
  plan.zero.prefetch = 1;
  plan.gradient_sync.kind = dp::GradientSyncKind::kNaive;
  expect_refused(plan, "--zero_stage 3 reduce-scatters gradient buckets: it needs --grad_sync bucketed, not naive");
  plan.gradient_sync.kind = dp::GradientSyncKind::kBucketed;
  plan.gradient_sync.allreduce = dp::AllReduceAlgorithm::kRing;
  expect_refused(plan, "it cannot take --allreduce ring");
  plan.gradient_sync.allreduce = dp::AllReduceAlgorithm::kBuiltin;
  EXPECT_NO_THROW(plan.validate());
  plan.zero.stage = 2;
  plan.elastic = true;
  expect_refused(plan, "--elastic with --zero_stage 2: a lost rank's shard of the optimizer state and of the gradients");
  plan.zero.stage = 0;
  plan.min_replicas = 5;
  expect_refused(plan, "--min_replicas 5: expected 1 to 4");
  plan.world_size = 1;
  plan.min_replicas = 1;
  expect_refused(plan, "--elastic keeps training when a data-parallel replica is lost: it needs at least 2 replicas");
}

TEST(Plan, ACheckpointRecordsEveryChoiceUnderItsFlagsName) {
  Plan plan = sized(8, 2, 1, 2);
  plan.zero.stage = 1;
  plan.pipeline.schedule = pipeline::ScheduleKind::kInterleaved;
  plan.pipeline.virtual_stages = 2;
  plan.pipeline.balance.halves_per_stage = {3, 1, 2, 2};
  plan.gradient_sync.reduce_dtype = at::kBFloat16;
  const nlohmann::json json = plan_to_json(plan);
  EXPECT_EQ(json.at("world_size"), 8);
  EXPECT_EQ(json.at("data_parallel_size"), 2);
  EXPECT_EQ(json.at("tensor_parallel_size"), 2);
  EXPECT_EQ(json.at("pipeline_parallel_size"), 2);
  EXPECT_EQ(json.at("zero_stage"), 1);
  EXPECT_EQ(json.at("pipeline_schedule"), "interleaved");
  EXPECT_EQ(json.at("virtual_stages"), 2);
  EXPECT_EQ(json.at("balance"), "1.5,0.5,1,1");
  EXPECT_EQ(json.at("grad_sync"), "bucketed");
  EXPECT_EQ(json.at("grad_reduce_dtype"), "bf16");
  EXPECT_EQ(json.at("elastic"), false);
  plan.pipeline.balance.automatic = true;
  EXPECT_EQ(plan_to_json(plan).at("balance"), "auto");
}

}  // namespace
}  // namespace harness::train
