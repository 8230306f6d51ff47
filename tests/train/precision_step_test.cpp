// --precision bf16 through the training steps: weights, gradients and AdamW state stay fp32, the
// loss moves by bf16's rounding only, and the pipeline's worker threads (recomputation included)
// run their stages under autocast too.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "harness/data/collate.h"
#include "harness/model/gpt2.h"
#include "harness/train/step/pipeline_train_step.h"
#include "harness/train/step/train_step.h"
#include "test_support.h"

namespace harness::train {
namespace {

model::GPT2Config tiny_config() { return testing::tiny_config(2, 0.0); }
using testing::make_model;

data::Batch make_batch(const model::GPT2Config& config) {
  torch::manual_seed(42);
  data::Batch b;
  b.input_ids = torch::randint(config.vocab_size, {8, 12}, torch::kLong);
  b.labels = torch::randint(config.vocab_size, {8, 12}, torch::kLong);
  b.label_token_weights = (torch::rand({8, 12}) > 0.2).to(torch::kFloat32);
  return b;
}

TrainStepSettings in(model::Precision precision) {
  TrainStepSettings settings;
  settings.precision = precision;
  return settings;
}

double first_loss(TrainStep& step, const data::Batch& batch) {
  step.set_training(true);
  return step.step(batch);
}

TEST(PrecisionStep, Bf16KeepsWeightsGradientsAndOptimizerStateFp32) {
  const model::GPT2Config config = tiny_config();
  const data::Batch batch = make_batch(config);
  GPT2TrainStep fp32(make_model(config), 1e-3, nullptr, in(model::Precision::kFp32));
  GPT2TrainStep bf16(make_model(config), 1e-3, nullptr, in(model::Precision::kBf16));
  EXPECT_EQ(bf16.settings().precision, model::Precision::kBf16);
  const double fp32_loss = first_loss(fp32, batch);
  const double bf16_loss = first_loss(bf16, batch);
  EXPECT_NEAR(bf16_loss, fp32_loss, 1e-2 * fp32_loss);
  EXPECT_NE(bf16_loss, fp32_loss);
  bf16.step(batch);
  for (const auto& p : bf16.model()->named_parameters()) {
    EXPECT_EQ(p.value().scalar_type(), at::kFloat) << p.key();
    EXPECT_EQ(p.value().grad().scalar_type(), at::kFloat) << p.key();
  }
  for (const auto& [name, state] : bf16.optimizer_state()) {
    EXPECT_EQ(state.exp_avg.scalar_type(), at::kFloat) << name;
    EXPECT_EQ(state.exp_avg_sq.scalar_type(), at::kFloat) << name;
  }
}

TEST(PrecisionStep, PipelineWorkersRunTheirStagesUnderAutocastRecomputationIncluded) {
  const model::GPT2Config config = tiny_config();
  const data::Batch batch = make_batch(config);
  GPT2TrainStep single(make_model(config), 1e-3, nullptr, in(model::Precision::kBf16));
  const double single_bf16 = first_loss(single, batch);
  auto pipeline_step = [&](pipeline::ActivationCheckpointing checkpointing, model::Precision precision) {
    PipelineStepOptions options;
    options.devices = {Device::cpu(0), Device::cpu(1)};
    options.schedule = pipeline::ScheduleKind::kOneFOneB;
    options.micro_batches = 2;
    options.threads_per_device = 1;
    options.checkpointing = checkpointing;
    return std::make_unique<PipelineTrainStep>(make_model(config), 1e-3, options, in(precision));
  };
  auto fp32 = pipeline_step(pipeline::ActivationCheckpointing::kNever, model::Precision::kFp32);
  auto bf16 = pipeline_step(pipeline::ActivationCheckpointing::kNever, model::Precision::kBf16);
  auto recomputed = pipeline_step(pipeline::ActivationCheckpointing::kAlways, model::Precision::kBf16);
  const double fp32_loss = first_loss(*fp32, batch);
  const double bf16_loss = first_loss(*bf16, batch);
  const double recomputed_loss = first_loss(*recomputed, batch);
  EXPECT_NE(bf16_loss, fp32_loss);  // the workers did compute in bf16
  EXPECT_NEAR(bf16_loss, single_bf16, 1e-2 * single_bf16);
  // Recomputing a stage's forward under the same autocast gives the same gradients bit for bit.
  EXPECT_EQ(recomputed_loss, bf16_loss);
  const auto a = bf16->unsplit_gradients(), b = recomputed->unsplit_gradients();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
}

}  // namespace
}  // namespace harness::train
