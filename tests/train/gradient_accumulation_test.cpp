// Gradient accumulation (--gradient_accumulation_steps): N batches per optimizer step, each loss
// weighted over the label weight of all N, equal to one step on the N batches concatenated, on
// one device and through the pipeline; one batch keeps today's arithmetic bit for bit.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "harness/data/collate.h"
#include "harness/model/gpt2.h"
#include "harness/model/loss.h"
#include "harness/train/step/pipeline_train_step.h"
#include "harness/train/step/train_step.h"
#include "test_support.h"

namespace harness::train {
namespace {

model::GPT2Config tiny_config() { return testing::tiny_config(2, 0.0); }
using testing::make_model;

// `count` batches of `rows` rows whose label weights differ (so that a plain mean of the batches'
// own means would not equal the combined batch's).
std::vector<data::Batch> make_batches(const model::GPT2Config& config, int count, int64_t rows, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<data::Batch> batches;
  for (int k = 0; k < count; ++k) {
    data::Batch b;
    b.input_ids = torch::randint(config.vocab_size, {rows, 12}, torch::kLong);
    b.labels = torch::randint(config.vocab_size, {rows, 12}, torch::kLong);
    b.label_token_weights = (torch::rand({rows, 12}) > 0.2 + 0.15 * k).to(torch::kFloat32);
    batches.push_back(b);
  }
  return batches;
}

data::Batch concatenated(const std::vector<data::Batch>& batches) {
  std::vector<at::Tensor> ids, labels, weights;
  for (const auto& b : batches) {
    ids.push_back(b.input_ids);
    labels.push_back(b.labels);
    weights.push_back(b.label_token_weights);
  }
  data::Batch out;
  out.input_ids = torch::cat(ids);
  out.labels = torch::cat(labels);
  out.label_token_weights = torch::cat(weights);
  return out;
}

using testing::gradients_of;
using testing::weights_of;

using testing::relative;

struct TrainedRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> first_gradients, weights;
};

// 3 optimizer steps: step k takes groups[k] (one batch or several, accumulated).
TrainedRun train(TrainStep& step, const std::vector<std::vector<data::Batch>>& groups) {
  TrainedRun run;
  step.set_training(true);
  for (size_t k = 0; k < groups.size(); ++k) {
    run.losses.push_back(step.step(groups[k]));
    if (k == 0) run.first_gradients = gradients_of(step);
  }
  run.weights = weights_of(step);
  return run;
}

void expect_same_run(const TrainedRun& actual, const TrainedRun& expected, double gradient_tolerance,
                     double weight_tolerance) {
  ASSERT_EQ(actual.losses.size(), expected.losses.size());
  for (size_t k = 0; k < expected.losses.size(); ++k) {
    EXPECT_NEAR(actual.losses[k], expected.losses[k], 1e-5 * std::abs(expected.losses[k])) << "step " << k;
  }
  ASSERT_EQ(actual.first_gradients.size(), expected.first_gradients.size());
  for (const auto& [name, g] : expected.first_gradients) {
    EXPECT_LE(relative(actual.first_gradients.at(name), g), gradient_tolerance) << name;
  }
  testing::expect_same_weights(actual.weights, expected.weights, expected.first_gradients, tiny_config().n_embd,
                               {1e-3, static_cast<int64_t>(expected.losses.size())}, weight_tolerance, "accumulated");
}

// 4 batches of 4 rows per step, 3 steps, against 3 steps on the 16-row concatenations.
struct Groups {
  std::vector<std::vector<data::Batch>> accumulated, combined;
};

Groups make_groups(const model::GPT2Config& config) {
  Groups g;
  for (int step = 0; step < 3; ++step) {
    std::vector<data::Batch> four = make_batches(config, 4, 4, 100 + step);
    g.combined.push_back({concatenated(four)});
    g.accumulated.push_back(std::move(four));
  }
  return g;
}

TEST(GradientAccumulation, FourBatchesEqualOneStepOnTheirConcatenation) {
  const model::GPT2Config config = tiny_config();
  const Groups groups = make_groups(config);
  GPT2TrainStep combined(make_model(config), 1e-3);
  const TrainedRun expected = train(combined, groups.combined);
  GPT2TrainStep accumulated(make_model(config), 1e-3);
  const TrainedRun actual = train(accumulated, groups.accumulated);
  expect_same_run(actual, expected, 1e-5, 1e-3);
}

TEST(GradientAccumulation, MeansOfEachBatchWouldDifferSoTheWeightingIsTested) {
  // The batches' label weights differ: the gradient of the mean of each batch's own mean loss is
  // another than the combined batch's, far beyond the tolerance the tests above use.
  const model::GPT2Config config = tiny_config();
  const std::vector<data::Batch> four = make_batches(config, 4, 4, 100);
  model::GPT2LMHeadModel model = make_model(config);
  at::Tensor mean_of_means = torch::zeros({});
  for (const auto& b : four) {
    mean_of_means = mean_of_means + model::weighted_cross_entropy(model->forward(b.input_ids), b.labels,
                                                           b.label_token_weights) / 4.0;
  }
  const at::Tensor& wte = model->transformer->wte->weight;
  mean_of_means.backward();
  const at::Tensor per_batch = wte.grad().clone();
  wte.mutable_grad() = at::Tensor();
  const data::Batch all = concatenated(four);
  model::weighted_cross_entropy(model->forward(all.input_ids), all.labels, all.label_token_weights).backward();
  EXPECT_GT(relative(per_batch, wte.grad()), 1e-2);
}

TEST(GradientAccumulation, OneBatchInAListIsTheSingleBatchStepBitForBit) {
  const model::GPT2Config config = tiny_config();
  const std::vector<data::Batch> batches = make_batches(config, 3, 4, 7);
  GPT2TrainStep single(make_model(config), 1e-3);
  GPT2TrainStep listed(make_model(config), 1e-3);
  for (const auto& b : batches) {
    EXPECT_EQ(single.step(b), listed.step(std::vector<data::Batch>{b}));
  }
  const auto a = weights_of(single), b = weights_of(listed);
  for (const auto& [name, w] : a) EXPECT_TRUE(torch::equal(w, b.at(name))) << name;
}

TEST(GradientAccumulation, ThroughThePipelineEqualsOneStepOnTheConcatenation) {
  const model::GPT2Config config = tiny_config();
  const Groups groups = make_groups(config);
  GPT2TrainStep combined(make_model(config), 1e-3);
  const TrainedRun expected = train(combined, groups.combined);
  for (const pipeline::ScheduleKind schedule : {pipeline::ScheduleKind::kGpipe, pipeline::ScheduleKind::kOneFOneB}) {
    PipelineStepOptions options;
    options.devices = {Device::cpu(0), Device::cpu(1)};
    options.schedule = schedule;
    options.micro_batches = 2;
    options.threads_per_device = 1;
    PipelineTrainStep accumulated(make_model(config), 1e-3, options);
    SCOPED_TRACE(pipeline::to_string(schedule));
    expect_same_run(train(accumulated, groups.accumulated), expected, 1e-5, 1e-3);
  }
}

TEST(GradientAccumulation, AStepWithoutBatchesOrLabelWeightIsRefused) {
  const model::GPT2Config config = tiny_config();
  GPT2TrainStep step(make_model(config), 1e-3);
  EXPECT_THROW(step.step(std::vector<data::Batch>{}), std::invalid_argument);
  std::vector<data::Batch> batches = make_batches(config, 2, 2, 3);
  for (auto& b : batches) b.label_token_weights.zero_();
  EXPECT_THROW(step.step(batches), std::invalid_argument);
}

}  // namespace
}  // namespace harness::train
