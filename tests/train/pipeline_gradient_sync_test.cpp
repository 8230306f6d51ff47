// The data-parallel gradient sync inside a pipeline step, over 4 processes (2 stages x 2 replicas,
// worker scenario "overlap"): each stage's buckets start during the schedule's backward passes, as
// soon as their parameters' last micro-batch backward completes them, not at finalize(); the
// averaged gradients and weights are those of the per-parameter all-reduce after the schedule.
#include <gtest/gtest.h>
#include <torch/torch.h>

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
#include "harness/train/pipeline_forward_backward.h"
#include "harness/train/step_optimizer.h"
#include "harness/train/train_step.h"

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

void overlap_scenario(const dp::WorkerEnv& env) {
  dp::DistOptions options = dp::dist_options_for(env, dp::Backend::kGloo);
  options.timeout = std::chrono::seconds(120);
  const dp::DistContext world = dp::init_process_group(options);
  parallel::LayoutSizes two_stages;
  two_stages.pipeline = 2;
  const parallel::Layout layout = parallel::Layout::create(env.world_size, two_stages);
  const parallel::ProcessGroups groups = parallel::make_process_groups(world, options, layout);
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

TEST(PipelineGradientSync, BucketsStartDuringTheScheduleAndAverageLikeTheNaiveSyncAfterIt) {
  const auto launch = test_workers::launch_test_workers("train_tests", "PipelineSyncWorker.Run", "overlap", 4);
  EXPECT_EQ(launch.result.exit_code, 0) << launch.result.failure << "\n" << launch.joined();
}

TEST(PipelineSyncWorker, Run) {
  const char* scenario = std::getenv(test_workers::kWorkerVariable);
  if (scenario == nullptr) GTEST_SKIP() << "only run as a worker by the launcher tests";
  const auto env = dp::worker_env_from_environment();
  ASSERT_TRUE(env.has_value()) << "a worker needs RANK/WORLD_SIZE from the launcher";
  if (std::string(scenario) == "overlap") {
    overlap_scenario(*env);
  } else {
    FAIL() << "unknown scenario " << scenario;
  }
  if (!::testing::Test::HasFailure()) {
    std::printf("scenario %s passed on rank %d\n", scenario, env->rank);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace harness::train
