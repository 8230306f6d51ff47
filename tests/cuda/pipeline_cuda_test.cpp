// The pipeline on GPUs. Two stages on one GPU use the same engine threads as two GPUs do (the
// autograd engine runs every cuda:0 node on one device thread), so one GPU exercises what a
// pipelined backward could deadlock on:
//   * Pipe (the original's a5_2_2 GPipe, backward through the engine) with partitions on cuda:0,
//     a CPU lane and cuda:0 again; GPT-2 through enable_pipeline on cuda:0 (and a CPU lane);
//   * PipelineTrainStep (the schedule executor, explicit per-stage backward on the workers) with
//     two stages on cuda:0, for GPipe, 1F1B and interleaved 1F1B, with and without activation
//     checkpointing, and model parallel, against the same model trained on cuda:0 alone;
//   * with dropout on, a seed reproduces the run.
// With two GPUs the same runs go over cuda:0,cuda:1 (real device-to-device copies).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "../train/test_support.h"
#include "cuda_test_support.h"
#include "harness/model/gpt2.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/pipeline/pipe.h"
#include "harness/pipeline/with_device.h"
#include "harness/model/loss.h"
#include "harness/train/step/pipeline_train_step.h"
#include "harness/train/step/train_step.h"

namespace harness {
namespace {

using cuda_testing::Snapshot;
using pipeline::ActivationCheckpointing;
using train::testing::Layout;

// Linear - Sigmoid - Linear - Sigmoid - Linear, the parameters' devices given per Linear.
torch::nn::Sequential small_net(const std::vector<Device>& devices, bool wrap) {
  torch::manual_seed(0);
  torch::nn::Linear a(8, 16), b(16, 4), c(4, 4);
  if (!wrap) return torch::nn::Sequential(a, torch::nn::Sigmoid(), b, torch::nn::Sigmoid(), c);
  return torch::nn::Sequential(pipeline::WithDevice(a, devices[0]), pipeline::WithDevice(torch::nn::Sigmoid(), devices[0]),
                               pipeline::WithDevice(b, devices[1]), pipeline::WithDevice(torch::nn::Sigmoid(), devices[1]),
                               pipeline::WithDevice(c, devices[2]));
}

Snapshot gradients_by_position(torch::nn::Module& module) {
  Snapshot out;
  int k = 0;
  for (const auto& p : module.parameters()) out[std::to_string(k++)] = p.grad().detach().cpu().clone();
  return out;
}

void expect_pipe_equals_plain(const std::vector<Device>& devices, const std::string& label) {
  cuda_testing::ieee_fp32_matmuls();
  torch::nn::Sequential plain = small_net({}, false);
  const at::Tensor x = torch::randn({32, 8});
  const at::Tensor target = torch::randn({32, 4});
  at::Tensor x_plain = x.clone().requires_grad_();
  const at::Tensor expected = plain->forward(x_plain);
  torch::mse_loss(expected, target).backward();

  torch::nn::Sequential wrapped = small_net(devices, true);
  pipeline::PipeOptions options;
  options.threads_per_device = 1;
  pipeline::Pipe pipe(wrapped, /*split_size=*/8, options);
  EXPECT_EQ(pipe.devices().back(), devices.back()) << label;
  at::Tensor x_pipe = x.clone().requires_grad_();
  const at::Tensor y = pipe.forward(x_pipe);
  EXPECT_EQ(y.device(), devices.back().torch_device()) << label << ": output on the last partition's device";
  EXPECT_LE(cuda_testing::relative_error(y, expected), cuda_testing::kTinyForwardTolerance) << label;
  torch::mse_loss(y, target.to(y.device())).backward();
  cuda_testing::expect_close(gradients_by_position(*wrapped), gradients_by_position(*plain),
                             cuda_testing::kTinyGradientTolerance, 1e-12, label + " gradients");
  EXPECT_LE(cuda_testing::relative_error(x_pipe.grad(), x_plain.grad()), cuda_testing::kTinyGradientTolerance) << label;
}

TEST(CudaPipe, PartitionsOnCuda0ACpuLaneAndCuda0AgainEqualThePlainModule) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  // Three partitions, two of them on cuda:0 (one worker thread), the engine's cuda:0 thread and a
  // CPU lane between them.
  expect_pipe_equals_plain({Device::cuda(0), Device::cpu(0), Device::cuda(0)}, "cuda:0 | cpu:0 | cuda:0");
}

TEST(CudaPipe, TwoGpusEqualThePlainModule) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  if (cuda_testing::gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs (cuda:0 and cuda:1)";
  expect_pipe_equals_plain({Device::cuda(0), Device::cuda(1), Device::cuda(0)}, "cuda:0 | cuda:1 | cuda:0");
}

TEST(CudaPipe, PipelinedBackwardIsRefusedOnAGpuWithTheReason) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  pipeline::PipeOptions options;
  options.pipelined_backward = true;
  try {
    pipeline::Pipe pipe(small_net({Device::cuda(0), Device::cpu(0), Device::cuda(0)}, true), 8, options);
    FAIL() << "a pipelined backward was accepted on cuda:0";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("CPU lanes only"), std::string::npos) << e.what();
  }
}

// GPT-2's blocks driven by a Pipe (run_pipeline's original path): logits and gradients equal the
// same model's on the CPU alone.
void expect_gpt2_pipe_equals_cpu(const std::vector<Device>& devices, int64_t split_size, const std::string& label) {
  cuda_testing::ieee_fp32_matmuls();
  const model::GPT2Config config = cuda_testing::config_of("gpt2-tiny", 4, 0.0);
  const data::Batch batch = cuda_testing::make_batches(config, 1, 8, 24).front();
  auto pass = [&](model::GPT2LMHeadModel& model) {
    const c10::Device first = model->parameters().front().device();
    const data::Batch b = cuda_testing::on_device(batch, first);
    const at::Tensor logits = model->forward(b.input_ids);
    model::weighted_cross_entropy(logits, b.labels.to(logits.device()), b.label_token_weights.to(logits.device()))
        .backward();
    return std::make_pair(logits.detach().cpu(), cuda_testing::gradients_of(*model));
  };
  model::GPT2LMHeadModel reference = cuda_testing::make_model(config);
  const auto expected = pass(reference);
  model::GPT2LMHeadModel model = cuda_testing::make_model(config);
  pipeline::PipeOptions options;
  options.threads_per_device = 1;
  auto pipe = pipeline::enable_pipeline(model, devices, split_size, options);
  const auto actual = pass(model);
  EXPECT_LE(cuda_testing::relative_error(actual.first, expected.first), cuda_testing::kTinyForwardTolerance) << label;
  cuda_testing::expect_close(actual.second, expected.second, cuda_testing::kTinyGradientTolerance,
                             cuda_testing::kGradientNormFloor, label);
}

TEST(CudaGpt2Pipe, OnCuda0AloneInFourMicroBatchesEqualsTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  expect_gpt2_pipe_equals_cpu({Device::cuda(0)}, 2, "pipeline on cuda:0");
}

TEST(CudaGpt2Pipe, OverCuda0AndACpuLaneEqualsTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  expect_gpt2_pipe_equals_cpu({Device::cuda(0), Device::cpu(1)}, 2, "pipeline on cuda:0,cpu:1");
  expect_gpt2_pipe_equals_cpu({Device::cuda(0), Device::cpu(1)}, 8, "model parallel on cuda:0,cpu:1");
}

TEST(CudaGpt2Pipe, OverTwoGpusEqualsTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  if (cuda_testing::gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs (cuda:0 and cuda:1)";
  expect_gpt2_pipe_equals_cpu({Device::cuda(0), Device::cuda(1)}, 2, "pipeline on cuda:0,cuda:1");
  expect_gpt2_pipe_equals_cpu({Device::cuda(0), Device::cuda(1)}, 8, "model parallel on cuda:0,cuda:1");
}

// ---- PipelineTrainStep: the schedules with the backward on the workers ------------------------


struct TrainedRun {
  std::vector<double> losses;
  Snapshot first_gradients, weights;
};

// Steps `step` through `batches` (moved to its input device), keeping each loss, the first step's
// gradients and the final weights of `model` (the step's own, shared).
TrainedRun train_on(train::TrainStep& step, model::GPT2LMHeadModel& model, const std::vector<data::Batch>& batches) {
  TrainedRun run;
  step.set_training(true);
  for (size_t k = 0; k < batches.size(); ++k) {
    run.losses.push_back(step.step(cuda_testing::on_device(batches[k], step.input_device())));
    if (k == 0) run.first_gradients = cuda_testing::gradients_of(*model);
  }
  run.weights = cuda_testing::weights_of(*model);
  return run;
}

TrainedRun train_pipeline(const model::GPT2Config& config, const Layout& layout, const std::vector<Device>& devices,
                          const std::vector<data::Batch>& batches, uint64_t seed = 5) {
  model::GPT2LMHeadModel model = cuda_testing::make_model(config);
  train::PipelineStepOptions o;
  o.devices = devices;
  o.schedule = layout.schedule;
  o.virtual_stages = layout.virtual_stages;
  o.micro_batches = layout.micro_batches;
  o.checkpointing = layout.checkpointing;
  o.threads_per_device = 1;
  o.seed = seed;
  train::PipelineTrainStep step(model, 1e-3, o);
  return train_on(step, model, batches);
}

std::vector<Layout> every_layout() {
  std::vector<Layout> layouts;
  for (auto mode : {ActivationCheckpointing::kNever, ActivationCheckpointing::kAlways}) {
    layouts.push_back({pipeline::ScheduleKind::kGpipe, 1, 4, mode});
    layouts.push_back({pipeline::ScheduleKind::kOneFOneB, 1, 4, mode});
    layouts.push_back({pipeline::ScheduleKind::kInterleaved, 2, 4, mode});
  }
  layouts.push_back({pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kExceptLast});
  layouts.push_back({pipeline::ScheduleKind::kOneFOneB, 1, 1, ActivationCheckpointing::kNever});  // model parallel
  return layouts;
}

void expect_every_schedule_matches_one_gpu(const std::vector<Device>& devices, const std::string& where) {
  cuda_testing::ieee_fp32_matmuls();
  const model::GPT2Config config = cuda_testing::config_of("gpt2-tiny", 4, 0.0);
  const std::vector<data::Batch> batches = cuda_testing::make_batches(config, 3, 8, 16);
  model::GPT2LMHeadModel alone = cuda_testing::make_model(config);
  alone->to(c10::Device(c10::kCUDA, 0));
  train::GPT2TrainStep single(alone, 1e-3);
  const TrainedRun expected = train_on(single, alone, batches);
  for (const Layout& layout : every_layout()) {
    const std::string label = where + " " + layout.name();
    const TrainedRun actual = train_pipeline(config, layout, devices, batches);
    ASSERT_EQ(actual.losses.size(), expected.losses.size()) << label;
    for (size_t k = 0; k < batches.size(); ++k) {
      EXPECT_NEAR(actual.losses[k], expected.losses[k], cuda_testing::kSameDeviceLossTolerance * std::abs(expected.losses[k]))
          << label << ": loss of step " << k;
    }
    cuda_testing::expect_close(actual.first_gradients, expected.first_gradients,
                               cuda_testing::kSameDeviceGradientTolerance, cuda_testing::kGradientNormFloor, label);
    cuda_testing::expect_same_weights(actual.weights, expected.weights, config.n_embd,
                                      {1e-3, static_cast<int64_t>(batches.size())},
                                      cuda_testing::kSameDeviceWeightTolerance, label);
  }
}

TEST(CudaPipelineTrainStep, TwoStagesOnCuda0MatchCuda0AloneForEverySchedule) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  expect_every_schedule_matches_one_gpu({Device::cuda(0), Device::cuda(0)}, "cuda:0,cuda:0");
}

TEST(CudaPipelineTrainStep, TwoGpusMatchCuda0AloneForEverySchedule) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  if (cuda_testing::gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs (cuda:0 and cuda:1)";
  expect_every_schedule_matches_one_gpu({Device::cuda(0), Device::cuda(1)}, "cuda:0,cuda:1");
}

// Dropout from the GPU's default generator, reseeded per (step, micro-batch, stage): the same seed
// gives the same first loss bit for bit (some CUDA backward kernels accumulate with atomics in any
// order, so the weights agree to rounding, the key third of c_attn.bias aside as everywhere),
// recomputation replays the masks, another seed differs.
TEST(CudaPipelineTrainStep, WithDropoutOnCuda0ASeedReproducesTheRun) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const model::GPT2Config config = cuda_testing::config_of("gpt2-tiny", 4, 0.1);
  const std::vector<data::Batch> batches = cuda_testing::make_batches(config, 2, 8, 16);
  const std::vector<Device> devices{Device::cuda(0), Device::cuda(0)};
  for (const Layout& layout : {Layout{pipeline::ScheduleKind::kOneFOneB, 1, 4, ActivationCheckpointing::kNever},
                               Layout{pipeline::ScheduleKind::kInterleaved, 2, 4, ActivationCheckpointing::kNever}}) {
    const TrainedRun a = train_pipeline(config, layout, devices, batches);
    const TrainedRun b = train_pipeline(config, layout, devices, batches);
    Layout always = layout;
    always.checkpointing = ActivationCheckpointing::kAlways;
    const TrainedRun recomputed = train_pipeline(config, always, devices, batches);
    EXPECT_EQ(a.losses[0], b.losses[0]) << layout.name();
    EXPECT_EQ(a.losses[0], recomputed.losses[0]) << layout.name() << ": recomputation drew other masks";
    const test_support::AdamWSteps steps{1e-3, static_cast<int64_t>(batches.size())};
    cuda_testing::expect_same_weights(b.weights, a.weights, config.n_embd, steps, 1e-3, layout.name());
    cuda_testing::expect_same_weights(recomputed.weights, a.weights, config.n_embd, steps, 1e-3,
                                      layout.name() + " recomputed");
    const TrainedRun other = train_pipeline(config, layout, devices, batches, /*seed=*/6);
    EXPECT_NE(other.losses[0], a.losses[0]) << layout.name() << ": dropout on, another seed, the same loss";
  }
}

}  // namespace
}  // namespace harness
