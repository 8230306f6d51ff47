// The optimizer step's global gradient norm and clipping against torch::nn::utils::clip_grad_norm_
// (LibTorch's port of torch.nn.utils.clip_grad_norm_) on one device: the norm it returns and the
// gradients it leaves, for one device and for the in-process pipeline over two CPU devices; with
// clipping off the norm is measured and the gradients left alone; the learning rate set between
// steps is the one AdamW uses.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness/data/collate.h"
#include "harness/train/step/pipeline_train_step.h"
#include "harness/train/step/train_step.h"
#include "test_support.h"

namespace harness::train {
namespace {

using testing::gradients_of;
using testing::make_model;
using testing::relative;
using testing::tiny_config;

data::Batch make_batch(const model::GPT2Config& config, int64_t rows) {
  torch::manual_seed(17);
  data::Batch b;
  b.input_ids = torch::randint(config.vocab_size, {rows, 16}, torch::kLong);
  b.labels = torch::randint(config.vocab_size, {rows, 16}, torch::kLong);
  b.label_token_weights = (torch::rand({rows, 16}) > 0.3).to(torch::kFloat32);
  return b;
}

struct Reference {
  double norm = 0.0;
  std::map<std::string, at::Tensor> clipped;  // the gradients clip_grad_norm_ leaves
};

// clip_grad_norm_ on copies of `gradients` (leaves with them as .grad).
Reference clip_grad_norm_reference(const std::map<std::string, at::Tensor>& gradients, double max_norm) {
  std::vector<at::Tensor> leaves;
  std::vector<std::string> names;
  for (const auto& [name, grad] : gradients) {
    at::Tensor leaf = torch::zeros_like(grad).requires_grad_(true);
    leaf.mutable_grad() = grad.clone();
    leaves.push_back(leaf);
    names.push_back(name);
  }
  Reference out;
  out.norm = torch::nn::utils::clip_grad_norm_(leaves, max_norm);
  for (size_t i = 0; i < leaves.size(); ++i) out.clipped[names[i]] = leaves[i].grad().clone();
  return out;
}

// One step of `step` on `batch`: the gradients before the optimizer step (after_backward) and
// after it (what AdamW was given).
struct StepGradients {
  std::map<std::string, at::Tensor> before, after;
};
StepGradients one_step(TrainStep& step, const data::Batch& batch) {
  StepGradients out;
  step.after_backward = [&] {
    // Copies: an unsplit CPU model's gradients come back as the tensors the step then scales.
    for (const auto& [name, grad] : gradients_of(step)) out.before[name] = grad.clone();
  };
  step.set_training(true);
  step.step(batch);
  step.after_backward = nullptr;
  out.after = gradients_of(step);
  return out;
}

OptimizerSettings clipping(double max_grad_norm) {
  OptimizerSettings s(1e-3);
  s.max_grad_norm = max_grad_norm;
  return s;
}

TEST(GradClip, OneDeviceEqualsClipGradNormInNormAndGradients) {
  const model::GPT2Config config = tiny_config(2, 0.0);
  const data::Batch batch = make_batch(config, 4);
  GPT2TrainStep step(make_model(config), clipping(0.05));
  const StepGradients g = one_step(step, batch);
  const Reference reference = clip_grad_norm_reference(g.before, 0.05);
  ASSERT_GT(reference.norm, 0.05) << "the test needs a step that clips";
  EXPECT_NEAR(step.last_grad_norm(), reference.norm, 1e-6 * reference.norm);
  ASSERT_EQ(g.after.size(), reference.clipped.size());
  for (const auto& [name, grad] : reference.clipped) {
    EXPECT_LT(relative(g.after.at(name), grad), 1e-6) << name;
  }
}

TEST(GradClip, OffMeasuresTheNormAndLeavesTheGradients) {
  const model::GPT2Config config = tiny_config(2, 0.0);
  const data::Batch batch = make_batch(config, 4);
  GPT2TrainStep step(make_model(config), clipping(0.0));
  const StepGradients g = one_step(step, batch);
  const Reference reference = clip_grad_norm_reference(g.before, 1e9);
  EXPECT_NEAR(step.last_grad_norm(), reference.norm, 1e-6 * reference.norm);
  for (const auto& [name, grad] : g.before) EXPECT_TRUE(torch::equal(g.after.at(name), grad)) << name;
  // A bound above the norm leaves them too (clip_grad_norm_'s coefficient is capped at 1).
  EXPECT_EQ(clip_coefficient(reference.norm, 2 * reference.norm), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(3.0, 1.5), 1.5 / (3.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(3.0, 0.0), 1.0);
}

TEST(GradClip, InProcessPipelineOverTwoDevicesEqualsOneDevice) {
  const model::GPT2Config config = tiny_config(4, 0.0);
  const data::Batch batch = make_batch(config, 4);
  GPT2TrainStep alone(make_model(config), clipping(0.05));
  const Reference reference = clip_grad_norm_reference(one_step(alone, batch).before, 0.05);
  PipelineStepOptions options;
  options.devices = {Device::cpu(0), Device::cpu(1)};
  options.micro_batches = 2;
  options.threads_per_device = 1;
  PipelineTrainStep piped(make_model(config), clipping(0.05), options);
  const StepGradients g = one_step(piped, batch);
  EXPECT_NEAR(piped.last_grad_norm(), reference.norm, 1e-6 * reference.norm);
  for (const auto& [name, grad] : reference.clipped) {
    EXPECT_LT(relative(g.after.at(name), grad), 1e-5) << name;
  }
}

// A step whose gradient holds a NaN (or an infinity) is skipped: its norm says so, and the run goes
// on bit for bit as if that batch had not been trained on (weights and AdamW's moments and step
// counts untouched), on one device and through the in-process pipeline, clipping on or off.
TEST(GradClip, ANonFiniteGradientSkipsTheStepAndLeavesTheStateUntouched) {
  const model::GPT2Config config = tiny_config(4, 0.0);
  const data::Batch poisoned = make_batch(config, 4);
  torch::manual_seed(23);
  data::Batch next = make_batch(config, 4);
  next.input_ids = torch::randint(config.vocab_size, {4, 16}, torch::kLong);
  PipelineStepOptions options;
  options.devices = {Device::cpu(0), Device::cpu(1)};
  options.micro_batches = 2;
  options.threads_per_device = 1;
  for (const double max_norm : {0.0, 0.05}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      for (const bool piped : {false, true}) {
        const std::string label = std::string(piped ? "pipeline" : "one device") + ", max_grad_norm " +
                                  std::to_string(max_norm) + ", " + std::to_string(bad);
        auto make = [&]() -> std::unique_ptr<TrainStep> {
          if (piped) return std::make_unique<PipelineTrainStep>(make_model(config), clipping(max_norm), options);
          return std::make_unique<GPT2TrainStep>(make_model(config), clipping(max_norm));
        };
        std::unique_ptr<TrainStep> clean = make();
        clean->set_training(true);
        clean->step(next);
        std::unique_ptr<TrainStep> skipped = make();
        skipped->after_backward = [&] {
          torch::NoGradGuard no_grad;
          for (const auto& p : skipped->model()->named_parameters()) {
            if (p.key() == "transformer.h.1.mlp.c_fc.weight") p.value().grad().view(-1)[7] = bad;
          }
        };
        skipped->set_training(true);
        skipped->step(poisoned);
        EXPECT_FALSE(std::isfinite(skipped->last_grad_norm())) << label;
        for (const auto& [name, weight] : testing::weights_of(*skipped)) {
          EXPECT_TRUE(torch::equal(weight, testing::weights_of(*make()).at(name))) << label << ": " << name;
        }
        skipped->after_backward = nullptr;
        skipped->step(next);
        const auto expected = testing::weights_of(*clean);
        for (const auto& [name, weight] : testing::weights_of(*skipped)) {
          EXPECT_TRUE(torch::equal(weight, expected.at(name))) << label << ": " << name;
        }
      }
    }
  }
}

TEST(GradClip, TheLearningRateSetBetweenStepsIsTheOneAdamWTakes) {
  const model::GPT2Config config = tiny_config(2, 0.0);
  const data::Batch batch = make_batch(config, 4);
  GPT2TrainStep step(make_model(config), OptimizerSettings(1e-3));
  EXPECT_EQ(step.learning_rate(), 1e-3);
  step.set_learning_rate(0.0);
  EXPECT_EQ(step.learning_rate(), 0.0);
  const auto before = testing::weights_of(step);
  step.set_training(true);
  step.step(batch);
  // Rate 0: neither the update nor the decoupled decay moves a weight.
  for (const auto& [name, weight] : testing::weights_of(step)) EXPECT_TRUE(torch::equal(weight, before.at(name))) << name;
  step.set_learning_rate(1e-3);
  step.step(batch);
  EXPECT_FALSE(torch::equal(testing::weights_of(step).at("transformer.wte.weight"), before.at("transformer.wte.weight")));
}

}  // namespace
}  // namespace harness::train
