// The activation meter counts what forwards allocate, per device, until it is freed; through the
// executor it shows 1F1B holding fewer activations than GPipe and checkpointing fewer still.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "harness/pipeline/activation_meter.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {
namespace {

TEST(ActivationMeter, ChargesAllocationsInsideAScopeUntilFreed) {
  install_activation_meter();
  ASSERT_TRUE(activation_meter_installed());
  const int64_t before = activation_live_bytes(3)[2];
  reset_activation_peaks();
  {
    at::Tensor outside = torch::empty({1000}, torch::kFloat32);
    EXPECT_EQ(activation_live_bytes(3)[2], before);
    at::Tensor inside;
    {
      ActivationScope scope(2);
      inside = torch::empty({1000}, torch::kFloat32);
      at::Tensor temporary = torch::empty({500}, torch::kFloat32);
    }
    EXPECT_EQ(activation_live_bytes(3)[2], before + 4000);
    EXPECT_EQ(activation_peak_bytes(3)[2], before + 6000);
  }
  EXPECT_EQ(activation_live_bytes(3)[2], before);
  EXPECT_THROW(ActivationScope(64), std::invalid_argument);
}

TEST(ActivationMeter, CountsEveryAllocationForTheProcessAndItsWindow) {
  install_activation_meter();
  const int64_t before = cpu_tensor_live_bytes();
  at::Tensor kept = torch::empty({2000}, torch::kFloat32);  // outside any scope: the process's only
  EXPECT_EQ(cpu_tensor_live_bytes(), before + 8000);
  EXPECT_GE(cpu_tensor_peak_bytes(), before + 8000);
  restart_cpu_tensor_window();
  EXPECT_EQ(cpu_tensor_window_increase(), 0);
  kept = at::Tensor();  // let go after the window began: the window's base stays where it was
  {
    at::Tensor a = torch::empty({1000}, torch::kFloat32);
    {
      ActivationScope scope(5);
      at::Tensor b = torch::empty({3000}, torch::kFloat32);
      EXPECT_EQ(cpu_tensor_live_bytes(), before + 16000);
    }
  }
  EXPECT_EQ(cpu_tensor_live_bytes(), before);
  EXPECT_EQ(cpu_tensor_window_increase(), 8000) << "16000 bytes at the most, over the 8000 live at the restart";
  restart_cpu_tensor_window();
  EXPECT_EQ(cpu_tensor_window_increase(), 0);
}

// Peak held activation bytes of the first device for one step of a 2-stage toy model.
int64_t first_device_held(const TrainingSchedule& schedule, ActivationCheckpointing mode) {
  torch::manual_seed(3);
  const at::Tensor w0 = torch::randn({64, 64}).requires_grad_(true);
  const at::Tensor w1 = torch::randn({64, 64}).requires_grad_(true);
  const at::Tensor x = torch::randn({64, 64});
  const std::vector<at::Tensor> chunks = x.tensor_split(schedule.micro_batches, 0);
  const StageForward forward = [&](int i, int s, const at::Tensor& input) {
    if (s == 0) return torch::tanh(torch::tanh(torch::matmul(chunks[i], w0)).matmul(w0));
    return torch::tanh(torch::matmul(input, w1)).sum();
  };
  ExecutorOptions options;
  options.threads_per_device = 1;
  options.checkpointing = mode;
  ScheduleExecutor executor({Device::cpu(0), Device::cpu(1)}, options);
  reset_activation_peaks();
  const int64_t live_before = activation_live_bytes(1)[0];
  const StepResult result = executor.run(schedule, forward, 1);
  EXPECT_EQ(activation_live_bytes(1)[0], live_before) << "everything a step charged is freed by its end";
  EXPECT_GE(activation_peak_bytes(1)[0] - live_before, result.peak_held_bytes.at(0));
  return result.peak_held_bytes.at(0);
}

TEST(ActivationMeter, OneFOneBHoldsFewerActivationsThanGPipeAndCheckpointingFewerStill) {
  install_activation_meter();
  const int64_t gpipe = first_device_held(gpipe_schedule(8, 2), ActivationCheckpointing::kNever);
  const int64_t one_f_one_b = first_device_held(one_f_one_b_schedule(8, 2), ActivationCheckpointing::kNever);
  const int64_t checkpointed = first_device_held(gpipe_schedule(8, 2), ActivationCheckpointing::kAlways);
  // Stage 0 keeps two tanh outputs of 8 x 64 floats per micro-batch (the second is also what it
  // hands on): GPipe holds all 8 micro-batches', 1F1B at most 2. Checkpointed, it holds one
  // rebuilt graph during a backward, its current output, and outputs stage 1 has not taken yet.
  const int64_t tensor = 8 * 64 * 4;
  EXPECT_EQ(gpipe, 8 * 2 * tensor);
  EXPECT_EQ(one_f_one_b, 2 * 2 * tensor);
  EXPECT_GE(checkpointed, 2 * tensor);
  EXPECT_LE(checkpointed, 2 * tensor + 8 * tensor);
}

}  // namespace
}  // namespace harness::pipeline
