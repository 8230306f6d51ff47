// The composition point: which parts each data-parallel choice gives a layout without pipeline
// stages, on a world of one rank; what one process without a process group gets (run_pipeline's
// steps); and the options it refuses. Multi-rank layouts compose through it in every
// run_data_parallel test.
#include "harness/train/step/build_step.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../data_parallel/test_support.h"
#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/zero/sharded_units.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;

model::GPT2LMHeadModel tiny_model() {
  torch::manual_seed(3);
  return model::GPT2LMHeadModel(model::GPT2Config::preset("gpt2-tiny"));
}

struct OneRank {
  dp::DistContext world = dp::testing::one_rank();
  dp::DistOptions options;  // unused: every group of a one-rank layout is the world itself
  Plan plan(int zero_stage) const {
    Plan plan;
    plan.zero.stage = zero_stage;
    return plan;
  }
};

TEST(ComposeStep, EachDataParallelChoiceGivesItsParts) {
  OneRank one;
  struct Case {
    int zero_stage;
    std::string gradient_sync;
    std::string sync_kind;
  };
  for (const Case& c : {Case{0, "bucketed", "bucketed"}, Case{0, "naive", "naive"}, Case{1, "bucketed", "bucketed"},
                        Case{2, "bucketed", "bucketed"}, Case{3, "bucketed", "units"}}) {
    SCOPED_TRACE("zero_stage " + std::to_string(c.zero_stage) + ", " + c.gradient_sync);
    Plan plan = one.plan(c.zero_stage);
    plan.gradient_sync.kind = dp::parse_gradient_sync(c.gradient_sync);
    plan.gradient_sync.reduce_dtype = at::kBFloat16;
    const parallel::ProcessGroups groups = parallel::make_process_groups(one.world, one.options, plan.layout());
    StepComposition settings;
    model::GPT2LMHeadModel model = tiny_model();
    StepParts parts = compose_step(model, plan, groups, settings);
    ASSERT_NE(parts.forward_backward, nullptr);
    ASSERT_NE(parts.optimizer, nullptr);
    ASSERT_NE(parts.sync, nullptr);
    EXPECT_EQ(parts.stages, nullptr);
    const bool bucketed = dynamic_cast<dp::BucketedAllReduce*>(parts.sync.get()) != nullptr;
    const bool naive = dynamic_cast<dp::NaiveAllReduce*>(parts.sync.get()) != nullptr;
    const bool units = dynamic_cast<zero::ShardedUnits*>(parts.sync.get()) != nullptr;
    EXPECT_EQ(bucketed, c.sync_kind == "bucketed");
    EXPECT_EQ(naive, c.sync_kind == "naive");
    EXPECT_EQ(units, c.sync_kind == "units");
    EXPECT_EQ(parts.sync->reduce_dtype(), std::optional<at::ScalarType>(at::kBFloat16));
  }
}

TEST(ComposeStep, StageOptionsWithoutPipelineStagesAreRefused) {
  OneRank one;
  const Plan plan = one.plan(0);
  const parallel::ProcessGroups groups = parallel::make_process_groups(one.world, one.options, plan.layout());
  StepComposition settings;
  settings.stages = PipelineStepOptions{};
  try {
    compose_step(tiny_model(), plan, groups, settings);
    FAIL() << "stage options on a layout without stages were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("without pipeline stages"), std::string::npos) << e.what();
  }
}

// run_pipeline's process has no process group: the whole model and its AdamW without a
// synchronizer, or, given stage options, its stages over its devices; ZeRO has nothing to shard over.
TEST(ComposeStep, OneProcessWithoutAGroupGetsTheWholeModelOrItsStages) {
  Plan plan;
  StepComposition settings;
  StepParts whole = compose_step(tiny_model(), plan, parallel::ProcessGroups{}, settings);
  ASSERT_NE(whole.forward_backward, nullptr);
  ASSERT_NE(whole.optimizer, nullptr);
  EXPECT_EQ(whole.sync, nullptr);
  EXPECT_EQ(whole.stages, nullptr);

  PipelineStepOptions options;
  options.devices = {Device::cpu(0), Device::cpu(1)};
  options.schedule = pipeline::ScheduleKind::kOneFOneB;
  options.micro_batches = 2;
  options.threads_per_device = 1;
  settings.stages = options;
  StepParts staged = compose_step(tiny_model(), plan, parallel::ProcessGroups{}, settings);
  ASSERT_NE(staged.stages, nullptr);
  EXPECT_EQ(staged.forward_backward.get(), staged.stages);
  EXPECT_EQ(staged.stages->stages(), 2);
  EXPECT_EQ(staged.sync, nullptr);
  ASSERT_NE(staged.optimizer, nullptr);

  settings.stages.reset();
  plan.zero.stage = 1;
  try {
    compose_step(tiny_model(), plan, parallel::ProcessGroups{}, settings);
    FAIL() << "ZeRO without a process group was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ZeRO shards over a process group"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace harness::train
