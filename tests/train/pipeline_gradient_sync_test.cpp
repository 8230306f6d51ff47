// The data-parallel gradient sync inside a pipeline step, over 4 processes (2 stages x 2 replicas,
// worker scenario "overlap"): each stage's buckets start during the schedule's backward passes, as
// soon as their parameters' last micro-batch backward completes them, not at finalize(); the
// averaged gradients and weights are those of the per-parameter all-reduce after the schedule.
// Scenario "post_validation": under a zero-bubble schedule, the stages that step before the global
// norm arrives end bit for bit where the synchronous step does, clipped or not, with a NaN.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "../support/multi_process.h"
#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/parallel/layout.h"
#include "harness/parallel/process_groups.h"
#include "harness/train/step/build_step.h"
#include "harness/train/step/pipeline_forward_backward.h"
#include "harness/train/step/step_optimizer.h"
#include "harness/train/step/train_step.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;

model::GPT2Config tiny_config() {
  model::GPT2Config config;
  config.vocab_size = 61;
  config.n_positions = 16;
  config.n_embd = 32;
  config.n_layer = 2;
  config.n_head = 4;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  return config;
}

// Replica d's batch of 8 rows (the same on both of its stages).
data::Batch replica_batch(const model::GPT2Config& config, int d, int k) {
  torch::manual_seed(99 + 10 * d + k);
  data::Batch b;
  b.input_ids = torch::randint(config.vocab_size, {8, 16}, torch::kLong);
  b.labels = torch::randint(config.vocab_size, {8, 16}, torch::kLong);
  b.label_token_weights = (torch::rand({8, 16}) > 0.3).to(torch::kFloat32);
  return b;
}

// What one run of three steps left: each step's averaged gradients of this rank's stage and the
// buckets started before finalize() (bucketed only), then the weights.
struct StageRun {
  std::vector<std::map<std::string, at::Tensor>> gradients;
  std::vector<int64_t> launched_during_backward;
  std::vector<int64_t> communicated_bytes;
  int64_t buckets = 0;
  int64_t one_reduction_bytes = 0;  // every gradient once, and the agreement flags
  std::map<std::string, at::Tensor> weights;
};

StageRun train_stage(const parallel::ProcessGroups& groups, const std::string& kind) {
  const model::GPT2Config config = tiny_config();
  torch::manual_seed(1234);
  model::GPT2LMHeadModel model(config);
  PipelineStepOptions options;
  options.devices = {Device::cpu(0)};
  options.schedule = pipeline::ScheduleKind::kOneFOneB;
  options.micro_batches = 4;
  auto forward_backward = std::make_unique<PipelineForwardBackward>(
      model, options, PipelineProcesses{groups.pipeline, groups.embedding, false});
  PipelineStageParameters held;
  held.held = forward_backward->held_parameters();
  for (const auto& item : model->named_parameters()) held.owner[item.key()] = forward_backward->owner_of(item.key());
  held.pipeline = groups.pipeline;
  std::vector<at::Tensor> parameters;
  for (const auto& item : model->named_parameters()) {
    if (std::find(held.held.begin(), held.held.end(), item.key()) != held.held.end()) parameters.push_back(item.value());
  }
  // A 2 KiB cap: several buckets per stage, so that launching in order during backward is seen.
  std::unique_ptr<dp::GradientSynchronizer> sync =
      kind == "bucketed" ? std::make_unique<dp::BucketedAllReduce>(groups.data, 2.0 / 1024)
                         : dp::make_gradient_synchronizer(dp::parse_gradient_sync(kind), groups.data);
  sync->attach(parameters);
  const auto* bucketed = dynamic_cast<const dp::BucketedAllReduce*>(sync.get());
  GPT2TrainStep step(model, std::move(forward_backward), stage_adamw(model, 1e-3, held), sync.get());
  step.set_training(true);
  StageRun run;
  if (bucketed) run.buckets = static_cast<int64_t>(bucketed->bucket_plan().size());
  run.one_reduction_bytes = 4 * (run.buckets + static_cast<int64_t>(parameters.size()));
  for (const at::Tensor& p : parameters) run.one_reduction_bytes += 4 * p.numel();
  const int d = groups.data.rank;
  // Steps of one batch, then one of two (gradient accumulation: the first batch under no_sync),
  // then one of a short batch of 3 rows (3 micro-batches, not 4).
  const std::vector<std::vector<data::Batch>> steps = {
      {replica_batch(config, d, 0)},
      {replica_batch(config, d, 1), replica_batch(config, d, 2)},
      {[&] {
        data::Batch b = replica_batch(config, d, 3);
        b.input_ids = b.input_ids.slice(0, 0, 3);
        b.labels = b.labels.slice(0, 0, 3);
        b.label_token_weights = b.label_token_weights.slice(0, 0, 3);
        return b;
      }()}};
  for (const auto& batches : steps) {
    const int64_t bytes = sync->communicated_bytes();
    step.step(batches);
    run.communicated_bytes.push_back(sync->communicated_bytes() - bytes);
    std::map<std::string, at::Tensor> gradients;
    for (const auto& item : model->named_parameters()) {
      if (item.value().grad().defined()) gradients[item.key()] = item.value().grad().clone();
    }
    run.gradients.push_back(gradients);
    if (bucketed) run.launched_during_backward.push_back(bucketed->launched_during_backward());
  }
  for (const auto& item : model->named_parameters()) {
    if (std::find(held.held.begin(), held.held.end(), item.key()) != held.held.end()) {
      run.weights[item.key()] = item.value().detach().clone();
    }
  }
  return run;
}

// The worker's world (Gloo) in the layout of 2 stages, D inferred, and its groups.
struct TwoStages {
  dp::DistContext world;
  parallel::Layout layout;
  parallel::ProcessGroups groups;
};

TwoStages two_stages_of(const dp::WorkerEnv& env) {
  dp::DistOptions options = dp::dist_options_for(env, dp::Backend::kGloo);
  options.timeout = std::chrono::seconds(120);
  dp::DistContext world = dp::init_process_group(options);
  parallel::LayoutSizes sizes;
  sizes.pipeline = 2;
  const parallel::Layout layout = parallel::Layout::create(env.world_size, sizes);
  parallel::ProcessGroups groups = parallel::make_process_groups(world, options, layout);
  return {std::move(world), layout, std::move(groups)};
}

void overlap_scenario(const dp::WorkerEnv& env) {
  const TwoStages setup = two_stages_of(env);
  const dp::DistContext& world = setup.world;
  const parallel::ProcessGroups& groups = setup.groups;
  ASSERT_EQ(groups.data.world_size, 2);
  const StageRun overlapped = train_stage(groups, "bucketed");
  const StageRun after_schedule = train_stage(groups, "naive");
  ASSERT_GE(overlapped.buckets, 3);
  for (size_t k = 0; k < overlapped.launched_during_backward.size(); ++k) {
    // Every parameter of the stage gets its last gradient accumulation in the schedule, so every
    // bucket has started before finalize(), and none too early (none is reduced twice).
    EXPECT_EQ(overlapped.launched_during_backward[k], overlapped.buckets) << "step " << k << " rank " << env.rank;
    EXPECT_EQ(overlapped.communicated_bytes[k], overlapped.one_reduction_bytes) << "step " << k << " rank " << env.rank;
  }
  ASSERT_EQ(overlapped.gradients.size(), after_schedule.gradients.size());
  for (size_t k = 0; k < overlapped.gradients.size(); ++k) {
    ASSERT_EQ(overlapped.gradients[k].size(), after_schedule.gradients[k].size()) << "step " << k;
    for (const auto& [name, grad] : after_schedule.gradients[k]) {
      ASSERT_TRUE(overlapped.gradients[k].count(name)) << name << " step " << k;
      EXPECT_TRUE(torch::equal(overlapped.gradients[k].at(name), grad)) << name << " step " << k;
    }
  }
  for (const auto& [name, weight] : after_schedule.weights) {
    EXPECT_TRUE(torch::equal(overlapped.weights.at(name), weight)) << name;
  }
  dp::barrier(world);
}

// Three zb1p steps of 2 stages x 2 replicas, composed as run_data_parallel composes them: each
// step's global norm, and then the unsplit weights and AdamW state (collectives), and the
// optimizer's post-validation tally on this rank. `wpe_factor[k]`: step k's wpe gradient (the
// first stage's) is multiplied by it as backward computes it (a hook on the leaf, so that every
// ZeRO stage's buckets and chunks take it).
struct ValidatedRun {
  std::vector<double> norms;
  std::map<std::string, at::Tensor> weights;
  OptimizerState state;
  StepOptimizer::PostValidation tally;
};

ValidatedRun zb1p_run(const parallel::Layout& layout, const parallel::ProcessGroups& groups, int zero_stage,
                      double max_grad_norm, bool post_validate, std::vector<double> wpe_factor = {1, 1, 1}) {
  const model::GPT2Config config = tiny_config();
  torch::manual_seed(1234);
  model::GPT2LMHeadModel model(config);
  StepComposition composition;
  composition.optimizer = OptimizerSettings(1e-2);
  composition.optimizer.max_grad_norm = max_grad_norm;
  composition.optimizer.post_validate = post_validate;
  Plan plan;  // the layout's sizes, ZeRO and the schedule
  plan.world_size = layout.world_size();
  plan.tensor_parallel_size = layout.tensor_parallel_size();
  plan.context_parallel_size = layout.context_parallel_size();
  plan.pipeline_parallel_size = layout.pipeline_parallel_size();
  plan.pipeline.schedule = pipeline::ScheduleKind::kZb1p;
  plan.zero.stage = zero_stage;
  plan.gradient_sync.bucket_cap_mb = 2.0 / 1024;  // several buckets, several chunks
  PipelineStepOptions stages;
  stages.devices = {Device::cpu(0)};
  stages.schedule = pipeline::ScheduleKind::kZb1p;
  stages.micro_batches = 4;
  composition.stages = stages;
  double factor = 1.0;
  model->transformer->wpe->weight.register_hook([&factor](const at::Tensor& grad) { return grad * factor; });
  StepParts parts = compose_step(model, plan, groups, composition);
  GPT2TrainStep step(model, std::move(parts.forward_backward), std::move(parts.optimizer), parts.sync.get());
  step.set_training(true);
  ValidatedRun run;
  for (size_t k = 0; k < wpe_factor.size(); ++k) {
    factor = wpe_factor[k];
    step.step(replica_batch(config, groups.data.rank, static_cast<int>(k)));
    run.norms.push_back(step.last_grad_norm());
  }
  run.state = step.optimizer_state();
  for (const auto& item : step.gathered_model()->named_parameters()) run.weights[item.key()] = item.value().detach().clone();
  run.tally = step.optimizer().post_validation();
  return run;
}

void expect_same_run(const ValidatedRun& got, const ValidatedRun& want, const std::string& label) {
  ASSERT_EQ(got.norms.size(), want.norms.size()) << label;
  for (size_t k = 0; k < got.norms.size(); ++k) {
    if (std::isnan(want.norms[k])) {
      EXPECT_TRUE(std::isnan(got.norms[k])) << label << ": step " << k;
    } else {
      EXPECT_EQ(got.norms[k], want.norms[k]) << label << ": step " << k;
    }
  }
  ASSERT_EQ(got.weights.size(), want.weights.size()) << label;
  for (const auto& [name, weight] : want.weights) EXPECT_TRUE(torch::equal(got.weights.at(name), weight)) << label << ": " << name;
  ASSERT_EQ(got.state.size(), want.state.size()) << label;
  for (const auto& [name, s] : want.state) {
    const auto& g = got.state.at(name);
    EXPECT_EQ(g.step, s.step) << label << ": " << name;
    EXPECT_TRUE(torch::equal(g.exp_avg, s.exp_avg) && torch::equal(g.exp_avg_sq, s.exp_avg_sq)) << label << ": " << name;
  }
}

void post_validation_scenario(const dp::WorkerEnv& env) {
  const TwoStages setup = two_stages_of(env);
  const dp::DistContext& world = setup.world;
  const parallel::Layout& layout = setup.layout;
  const parallel::ProcessGroups& groups = setup.groups;
  // The first stage's ranks wait for the norm (their backward ends last); the others step early,
  // from the second step on (the first has no unclipped step before it).
  const bool early = groups.pipeline.rank != 0;
  for (const int zero_stage : {0, 1, 3}) {
    const std::string zero = "zero_stage " + std::to_string(zero_stage) + ", rank " + std::to_string(env.rank);
    // Never clipped: the early steps stand.
    const ValidatedRun plain = zb1p_run(layout, groups, zero_stage, 1e9, false);
    const ValidatedRun plain_early = zb1p_run(layout, groups, zero_stage, 1e9, true);
    expect_same_run(plain_early, plain, "unclipped, " + zero);
    EXPECT_EQ(plain_early.tally.early, early ? 2 : 0) << zero;
    EXPECT_EQ(plain_early.tally.undone, 0) << zero;
    // Clipped at the third step alone, by the first stage's gradient (the second stage's own
    // norm does not say so): that early step is undone and taken again clipped.
    const double max_norm = 1.5 * *std::max_element(plain.norms.begin(), plain.norms.end());
    const std::vector<double> third_large = {1, 1, 1e3};
    const ValidatedRun clipped = zb1p_run(layout, groups, zero_stage, max_norm, false, third_large);
    ASSERT_LT(clip_coefficient(clipped.norms[2], max_norm), 1.0) << zero;
    const ValidatedRun clipped_early = zb1p_run(layout, groups, zero_stage, max_norm, true, third_large);
    expect_same_run(clipped_early, clipped, "clipped at the third step, " + zero);
    EXPECT_EQ(clipped_early.tally.early, early ? 2 : 0) << zero;
    EXPECT_EQ(clipped_early.tally.undone, early ? 1 : 0) << zero;
    // A NaN in the first stage's gradient at the second step: the early step is undone and
    // skipped; the third waits (the step before it was skipped), and is taken.
    const std::vector<double> second_nan = {1, NAN, 1};
    for (const double max : {0.0, max_norm}) {
      const std::string label = "NaN at the second step, max_grad_norm " + std::to_string(max) + ", " + zero;
      const ValidatedRun poisoned = zb1p_run(layout, groups, zero_stage, max, false, second_nan);
      ASSERT_TRUE(std::isnan(poisoned.norms[1])) << label;
      const ValidatedRun poisoned_early = zb1p_run(layout, groups, zero_stage, max, true, second_nan);
      expect_same_run(poisoned_early, poisoned, label);
      EXPECT_EQ(poisoned_early.tally.early, early ? 1 : 0) << label;
      EXPECT_EQ(poisoned_early.tally.undone, early ? 1 : 0) << label;
    }
  }
  dp::barrier(world);
}

TEST(PipelineGradientSync, PostValidatedStepsEqualTheSynchronousStepClippedOrNotAndWithANaN) {
  const auto launch = test_workers::launch_test_workers("train_tests", "PipelineSyncWorker.Run", "post_validation", 4);
  EXPECT_EQ(launch.result.exit_code, 0) << launch.result.failure << "\n" << launch.joined();
}

TEST(PipelineGradientSync, BucketsStartDuringTheScheduleAndAverageLikeTheNaiveSyncAfterIt) {
  const auto launch = test_workers::launch_test_workers("train_tests", "PipelineSyncWorker.Run", "overlap", 4);
  EXPECT_EQ(launch.result.exit_code, 0) << launch.result.failure << "\n" << launch.joined();
}

TEST(PipelineSyncWorker, Run) {
  test_workers::play_worker_scenario({{"overlap", overlap_scenario}, {"post_validation", post_validation_scenario}});
}

}  // namespace
}  // namespace harness::train
