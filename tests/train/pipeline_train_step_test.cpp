// GPT-2 trained through the schedule executor (PipelineTrainStep): with dropout off every schedule,
// checkpointing mode and number of virtual stages gives the single device's loss and gradients
// and, after 3 AdamW steps, its weights; with dropout on, a seed reproduces a run bit for bit
// whatever the thread timing, also while other threads keep the cores busy.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "harness/data/collate.h"
#include "harness/model/gpt2.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/train/step/pipeline_train_step.h"
#include "harness/train/step/train_step.h"
#include "test_support.h"

namespace harness::train {
namespace {

using pipeline::ActivationCheckpointing;
using testing::Layout;

model::GPT2Config tiny_config(double dropout) { return testing::tiny_config(4, dropout); }
using testing::make_model;

std::vector<data::Batch> make_batches(const model::GPT2Config& config, int count, int64_t rows) {
  torch::manual_seed(99);
  std::vector<data::Batch> batches;
  for (int k = 0; k < count; ++k) {
    data::Batch b;
    b.input_ids = torch::randint(config.vocab_size, {rows, 16}, torch::kLong);
    b.labels = torch::randint(config.vocab_size, {rows, 16}, torch::kLong);
    b.label_token_weights = (torch::rand({rows, 16}) > 0.3).to(torch::kFloat32);
    batches.push_back(b);
  }
  return batches;
}

using testing::gradients_of;
using testing::weights_of;

struct TrainedRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> first_gradients, weights;
};

TrainedRun train(TrainStep& step, const std::vector<data::Batch>& batches) {
  TrainedRun run;
  step.set_training(true);
  for (size_t k = 0; k < batches.size(); ++k) {
    run.losses.push_back(step.step(batches[k]));
    if (k == 0) run.first_gradients = gradients_of(step);
  }
  run.weights = weights_of(step);
  return run;
}


PipelineStepOptions options_for(const Layout& layout, uint64_t seed = 5) {
  PipelineStepOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.schedule = layout.schedule;
  o.virtual_stages = layout.virtual_stages;
  o.micro_batches = layout.micro_batches;
  o.checkpointing = layout.checkpointing;
  o.threads_per_device = 1;
  o.seed = seed;
  return o;
}

double relative(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-12);
}

TEST(PipelineTrainStep, EveryScheduleCheckpointingAndVirtualStagesMatchesOneDevice) {
  const model::GPT2Config config = tiny_config(0.0);
  const std::vector<data::Batch> batches = make_batches(config, 3, 8);
  GPT2TrainStep single(make_model(config), 1e-3);
  const TrainedRun expected = train(single, batches);

  std::vector<Layout> layouts;
  for (auto mode : {ActivationCheckpointing::kNever, ActivationCheckpointing::kExceptLast,
                    ActivationCheckpointing::kAlways}) {
    layouts.push_back({pipeline::ScheduleKind::kGpipe, 1, 4, mode});
    layouts.push_back({pipeline::ScheduleKind::kOneFOneB, 1, 4, mode});
    layouts.push_back({pipeline::ScheduleKind::kInterleaved, 2, 4, mode});
  }
  layouts.push_back({pipeline::ScheduleKind::kOneFOneB, 1, 1, ActivationCheckpointing::kNever});  // model parallel
  layouts.push_back({pipeline::ScheduleKind::kOneFOneB, 1, 8, ActivationCheckpointing::kNever});  // one row per micro-batch
  for (const Layout& layout : layouts) {
    PipelineTrainStep step(make_model(config), 1e-3, options_for(layout));
    const TrainedRun actual = train(step, batches);
    for (size_t k = 0; k < batches.size(); ++k) {
      EXPECT_NEAR(actual.losses[k], expected.losses[k], 1e-5 * std::abs(expected.losses[k]))
          << layout.name() << ": loss of step " << k;
    }
    ASSERT_EQ(actual.first_gradients.size(), expected.first_gradients.size()) << layout.name();
    for (const auto& [name, grad] : expected.first_gradients) {
      ASSERT_TRUE(actual.first_gradients.count(name)) << layout.name() << ": no gradient for " << name;
      EXPECT_LE(relative(actual.first_gradients.at(name), grad), 1e-5) << layout.name() << ": " << name;
    }
    testing::expect_same_weights(actual.weights, expected.weights, expected.first_gradients, config.n_embd,
                                 {1e-3, static_cast<int64_t>(batches.size())}, 1e-3, layout.name());
  }
}

TEST(PipelineTrainStep, ABlockCutBetweenItsHalvesStaysExact) {
  const model::GPT2Config config = tiny_config(0.0);
  const std::vector<data::Batch> batches = make_batches(config, 2, 8);
  GPT2TrainStep single(make_model(config), 1e-3);
  const TrainedRun expected = train(single, batches);
  for (const std::vector<int>& halves : {std::vector<int>{3, 5}, std::vector<int>{5, 3}, std::vector<int>{1, 7}}) {
    PipelineStepOptions o = options_for({pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kExceptLast});
    o.balance_halves = halves;
    PipelineTrainStep step(make_model(config), 1e-3, o);
    const TrainedRun actual = train(step, batches);
    const std::string what = step.balance_text();
    EXPECT_NEAR(actual.losses[1], expected.losses[1], 1e-5 * expected.losses[1]) << what;
    for (const auto& [name, grad] : expected.first_gradients) {
      EXPECT_LE(relative(actual.first_gradients.at(name), grad), 1e-5) << what << ": " << name;
    }
  }
  PipelineStepOptions o = options_for({pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever});
  o.balance_halves = {3, 5};
  PipelineTrainStep step(make_model(config), 1e-3, o);
  EXPECT_EQ(step.balance_text(), "1.5,2.5");
  // Block 1 is cut: its attention half on cpu:0, its MLP half on cpu:1 (one CPU, but the model
  // records the placement it would have on two GPUs).
  EXPECT_EQ(step.model()->block_devices()[1], Device::cpu(0));
  o.balance_halves = {3, 4};
  EXPECT_THROW(PipelineTrainStep(make_model(config), 1e-3, o), std::invalid_argument);
}

TEST(PipelineTrainStep, ABatchInterleavingCannotTakeRunsGPipeOrderAndStaysExact) {
  const model::GPT2Config config = tiny_config(0.0);
  const std::vector<data::Batch> batches = make_batches(config, 1, 3);  // 3 micro-batches, 2 devices
  GPT2TrainStep single(make_model(config), 1e-3);
  const TrainedRun expected = train(single, batches);
  PipelineTrainStep step(make_model(config), 1e-3,
                         options_for({pipeline::ScheduleKind::kInterleaved, 2, 4, ActivationCheckpointing::kNever}));
  const TrainedRun actual = train(step, batches);
  EXPECT_EQ(step.last_schedule().name, "gpipe");
  EXPECT_EQ(step.last_schedule().micro_batches, 3);
  EXPECT_NEAR(actual.losses[0], expected.losses[0], 1e-5 * expected.losses[0]);
  for (const auto& [name, grad] : expected.first_gradients) {
    EXPECT_LE(relative(actual.first_gradients.at(name), grad), 1e-5) << name;
  }
}

// Keeps every core busy with matrix products until stopped, so that the workers' timing shifts.
class Load {
 public:
  explicit Load(int threads) {
    for (int t = 0; t < threads; ++t) {
      threads_.emplace_back([this] {
        at::set_num_threads(1);
        // No draws from torch's default generator: the runs under test seed and use it.
        const at::Tensor a = torch::full({96, 96}, 0.01);
        at::Tensor b = a;
        while (!stop_) b = torch::tanh(torch::matmul(a, b));
      });
    }
  }
  ~Load() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

TEST(PipelineTrainStep, WithDropoutASeedReproducesTheRunBitForBitUnderLoad) {
  const model::GPT2Config config = tiny_config(0.1);
  const std::vector<data::Batch> batches = make_batches(config, 2, 8);
  for (const Layout& layout : {Layout{pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever},
                               Layout{pipeline::ScheduleKind::kInterleaved, 2, 4, ActivationCheckpointing::kExceptLast}}) {
    TrainedRun quiet, busy, checkpointed;
    {
      PipelineTrainStep step(make_model(config), 1e-3, options_for(layout));
      quiet = train(step, batches);
    }
    {
      Load load(3);
      PipelineTrainStep step(make_model(config), 1e-3, options_for(layout));
      busy = train(step, batches);
    }
    {
      Layout always = layout;
      always.checkpointing = ActivationCheckpointing::kAlways;
      PipelineTrainStep step(make_model(config), 1e-3, options_for(always));
      checkpointed = train(step, batches);
    }
    EXPECT_EQ(quiet.losses, busy.losses) << layout.name();
    for (const auto& [name, weight] : quiet.weights) {
      EXPECT_TRUE(torch::equal(busy.weights.at(name), weight)) << layout.name() << ": " << name;
      // Recomputation draws the same masks: checkpointing changes nothing, bit for bit.
      EXPECT_TRUE(torch::equal(checkpointed.weights.at(name), weight)) << layout.name() << ": " << name;
    }
    // Dropout is on: another seed gives another run.
    PipelineTrainStep other(make_model(config), 1e-3, options_for(layout, /*seed=*/6));
    EXPECT_NE(train(other, batches).losses, quiet.losses) << layout.name();
  }
}

// The split backward changes when the weight gradients are computed, not what they are: with
// dropout on, ZB-H1 trains bit for bit as 1F1B, and ZB-V as interleaved 1F1B over the same four
// stages (each stage's gradients accumulate over the micro-batches in the same order; only the
// device a stage runs on differs), checkpointed or not.
TEST(PipelineTrainStep, ZeroBubbleSchedulesTrainBitForBitAsTheirJointBackwardOrders) {
  const model::GPT2Config config = tiny_config(0.1);
  const std::vector<data::Batch> batches = make_batches(config, 2, 8);
  using Kind = pipeline::ScheduleKind;
  struct Pair {
    Layout joint, split;
  };
  const Pair pairs[] = {
      {{Kind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever}, {Kind::kZb1p, 1, 4, ActivationCheckpointing::kNever}},
      {{Kind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever}, {Kind::kZb1p, 1, 4, ActivationCheckpointing::kAlways}},
      {{Kind::kInterleaved, 2, 4, ActivationCheckpointing::kNever}, {Kind::kZbv, 2, 4, ActivationCheckpointing::kNever}},
      {{Kind::kInterleaved, 2, 4, ActivationCheckpointing::kNever},
       {Kind::kZbv, 2, 4, ActivationCheckpointing::kExceptLast}},
  };
  for (const Pair& pair : pairs) {
    PipelineTrainStep joint_step(make_model(config), 1e-3, options_for(pair.joint));
    const TrainedRun joint = train(joint_step, batches);
    PipelineTrainStep split_step(make_model(config), 1e-3, options_for(pair.split));
    const TrainedRun split = train(split_step, batches);
    const std::string label = pair.split.name() + " against " + pair.joint.name();
    EXPECT_EQ(split_step.pipeline().last_schedule().name, pipeline::to_string(pair.split.schedule));
    EXPECT_EQ(split.losses, joint.losses) << label;
    for (const auto& [name, grad] : joint.first_gradients) {
      EXPECT_TRUE(torch::equal(split.first_gradients.at(name), grad)) << label << ": the gradient of " << name;
    }
    for (const auto& [name, weight] : joint.weights) {
      EXPECT_TRUE(torch::equal(split.weights.at(name), weight)) << label << ": " << name;
    }
  }
}

TEST(PipelineTrainStep, TheGlobalStepPicksTheStreamsSoAResumedStepDrawsTheSameMasks) {
  const model::GPT2Config config = tiny_config(0.1);
  const std::vector<data::Batch> batches = make_batches(config, 2, 8);
  const Layout layout{pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever};
  PipelineTrainStep whole(make_model(config), 1e-3, options_for(layout));
  const TrainedRun expected = train(whole, batches);

  PipelineTrainStep first(make_model(config), 1e-3, options_for(layout));
  first.set_training(true);
  first.step(batches[0]);
  PipelineTrainStep resumed(make_model(config), 1e-3, options_for(layout));
  model::NamedTensors weights;
  for (const auto& [name, tensor] : weights_of(first)) weights.emplace_back(name, tensor);
  resumed.load_state(weights, first.optimizer_state());
  resumed.set_global_step(1);
  resumed.set_training(true);
  EXPECT_EQ(resumed.step(batches[1]), expected.losses[1]);
  for (const auto& [name, weight] : expected.weights) {
    EXPECT_TRUE(torch::equal(weights_of(resumed).at(name), weight)) << name;
  }
}

// The GPU path: two stages on one GPU (two workers sharing cuda:0: the explicit per-stage backward
// on the engine's device thread, the hand-offs between workers, and dropout drawn from the GPU's
// reseeded default generator) through every schedule, against the same model trained on that GPU
// alone; with dropout on, a seed reproduces the run. The copies between GPUs need two GPUs.
TEST(PipelineTrainStepCuda, TwoStagesOnOneGpuThroughEveryScheduleMatchTheGpuAlone) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (torch::cuda::is_available() is false)";
  const torch::Device gpu(torch::kCUDA, 0);
  const model::GPT2Config config = tiny_config(0.0);
  const std::vector<data::Batch> batches = make_batches(config, 3, 8);
  model::GPT2LMHeadModel alone = make_model(config);
  alone->to(gpu);
  GPT2TrainStep single(alone, 1e-3);
  std::vector<data::Batch> on_gpu;
  for (const auto& b : batches) on_gpu.push_back(b.to(gpu));
  const TrainedRun expected = train(single, on_gpu);
  for (const Layout& layout : {Layout{pipeline::ScheduleKind::kGpipe, 1, 4, ActivationCheckpointing::kNever},
                               Layout{pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kExceptLast},
                               Layout{pipeline::ScheduleKind::kInterleaved, 2, 4, ActivationCheckpointing::kAlways},
                               Layout{pipeline::ScheduleKind::kZb1p, 1, 4, ActivationCheckpointing::kNever},
                               Layout{pipeline::ScheduleKind::kZbv, 2, 4, ActivationCheckpointing::kExceptLast}}) {
    PipelineStepOptions o = options_for(layout);
    o.devices = {Device::cuda(0), Device::cuda(0)};
    PipelineTrainStep step(make_model(config), 1e-3, o);
    const TrainedRun actual = train(step, batches);
    for (size_t k = 0; k < batches.size(); ++k) {
      EXPECT_NEAR(actual.losses[k], expected.losses[k], 1e-4 * std::abs(expected.losses[k]))
          << layout.name() << ": loss of step " << k;
    }
    for (const auto& [name, grad] : expected.first_gradients) {
      EXPECT_LE(relative(actual.first_gradients.at(name), grad), 1e-4) << layout.name() << ": " << name;
    }
  }
  const model::GPT2Config noisy = tiny_config(0.1);
  PipelineStepOptions o = options_for({pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kExceptLast});
  o.devices = {Device::cuda(0), Device::cuda(0)};
  PipelineTrainStep first(make_model(noisy), 1e-3, o), second(make_model(noisy), 1e-3, o);
  const TrainedRun a = train(first, batches), b = train(second, batches);
  // The masks are the seed's; some CUDA backward kernels accumulate with atomics in any order, so
  // the first forward is bit-identical and the rest agree to rounding.
  EXPECT_EQ(a.losses[0], b.losses[0]);
  test_support::expect_weights_agree_after_adamw(b.weights, a.weights, noisy.n_embd,
                                                 {1e-3, static_cast<int64_t>(batches.size())}, 1e-3, "dropout");
}

TEST(PipelineTrainStep, BalancePlacesTheBlocksAndBadOptionsNameTheFlag) {
  const model::GPT2Config config = tiny_config(0.0);
  PipelineStepOptions o = options_for({pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever});
  o.balance = {3, 1};
  PipelineTrainStep step(make_model(config), 1e-3, o);
  const auto& blocks = step.model()->block_devices();
  EXPECT_EQ(blocks, (std::vector<Device>{Device::cpu(0), Device::cpu(0), Device::cpu(0), Device::cpu(1)}));

  auto message_of = [&](PipelineStepOptions bad) {
    try {
      PipelineTrainStep s(make_model(config), 1e-3, bad);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  PipelineStepOptions bad = o;
  bad.balance = {2, 1};
  EXPECT_NE(message_of(bad).find("sums to 3 but the model has 4 blocks"), std::string::npos) << message_of(bad);
  bad = o;
  bad.balance = {};
  // An unknown schedule cannot reach the options: the flag's parser refuses its name.
  EXPECT_THROW(
      {
        try {
          pipeline::parse_schedule_kind("zigzag");
        } catch (const std::invalid_argument& e) {
          EXPECT_EQ(std::string(e.what()), "--pipeline_schedule must be gpipe, 1f1b, interleaved, zb1p or zbv, got 'zigzag'");
          throw;
        }
      },
      std::invalid_argument);
  EXPECT_EQ(pipeline::parse_schedule_kind("interleaved"), pipeline::ScheduleKind::kInterleaved);
  EXPECT_EQ(pipeline::to_string(pipeline::ScheduleKind::kOneFOneB), "1f1b");
  bad.schedule = pipeline::ScheduleKind::kOneFOneB;
  bad.virtual_stages = 2;
  EXPECT_NE(message_of(bad).find("--virtual_stages 2 needs --pipeline_schedule interleaved"), std::string::npos)
      << message_of(bad);
  bad.schedule = pipeline::ScheduleKind::kInterleaved;
  bad.micro_batches = 3;
  EXPECT_NE(message_of(bad).find("multiple of the 2 devices"), std::string::npos) << message_of(bad);
}

TEST(PipelineTrainStep, BalanceByTimeGivesEveryStageHalfBlocksAndLeavesNoGradient) {
  model::GPT2LMHeadModel model = make_model(tiny_config(0.0));
  const std::vector<int> halves = pipeline::balance_gpt2_by_time(model, Device::cpu(0), 2, 2, 16);
  ASSERT_EQ(halves.size(), 2u);
  EXPECT_EQ(halves[0] + halves[1], 2 * 4);
  EXPECT_GE(halves[0], 1);
  EXPECT_GE(halves[1], 1);
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  PipelineStepOptions o = options_for({pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever});
  o.balance_halves = halves;
  EXPECT_NO_THROW(PipelineTrainStep(model, 1e-3, o));
}
}  // namespace
}  // namespace harness::train
