// GPT-2 on a GPU against the CPU: logits, SPEC §3's loss and every parameter's gradient of one
// forward and backward on cuda:0 equal the CPU's to fp32 rounding (tolerances in
// cuda_test_support.h: gpt2-tiny 1e-5 forward / 1e-4 gradients, gpt2 124M 1e-4 / 1e-3, relative,
// TF32 off); bf16 autocast on the GPU stays near fp32; a batch copied to the GPU (pinned memory,
// non_blocking) arrives intact.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <string>

#include "cuda_test_support.h"
#include "harness/data/collate.h"
#include "harness/model/gpt2.h"
#include "harness/model/precision.h"
#include "harness/model/loss.h"

namespace harness {
namespace {

using cuda_testing::Snapshot;

struct Pass {
  at::Tensor logits, loss;
  Snapshot gradients;
};

// One forward and backward of `model` (already on its device) on `batch`, under `precision`.
Pass forward_backward(model::GPT2LMHeadModel& model, const data::Batch& batch, const c10::Device& device,
                      model::Precision precision = model::Precision::kFp32) {
  model->zero_grad();
  const data::Batch b = cuda_testing::on_device(batch, device);
  Pass pass;
  {
    model::AutocastScope autocast(precision, device.type());
    pass.logits = model->forward(b.input_ids);
    pass.loss = model::weighted_cross_entropy(pass.logits, b.labels, b.label_token_weights);
  }
  pass.loss.backward();
  pass.gradients = cuda_testing::gradients_of(*model);
  return pass;
}

void expect_gpu_equals_cpu(const std::string& preset, int64_t rows, int64_t tokens, double forward_tolerance,
                           double gradient_tolerance) {
  cuda_testing::ieee_fp32_matmuls();
  const model::GPT2Config config = cuda_testing::config_of(preset, 0, 0.0);
  const data::Batch batch = cuda_testing::make_batches(config, 1, rows, tokens).front();
  model::GPT2LMHeadModel cpu_model = cuda_testing::make_model(config);
  model::GPT2LMHeadModel gpu_model = cuda_testing::make_model(config);
  const c10::Device cuda(c10::kCUDA, 0);
  gpu_model->to(cuda);
  const Pass expected = forward_backward(cpu_model, batch, c10::Device(c10::kCPU));
  const Pass actual = forward_backward(gpu_model, batch, cuda);

  EXPECT_TRUE(actual.logits.is_cuda());
  EXPECT_LE(cuda_testing::relative_error(actual.logits, expected.logits), forward_tolerance) << preset << ": logits";
  EXPECT_LE(cuda_testing::relative_error(actual.loss, expected.loss), forward_tolerance)
      << preset << ": loss " << actual.loss.item<double>() << " vs " << expected.loss.item<double>();
  ASSERT_EQ(actual.gradients.size(), expected.gradients.size()) << preset;
  cuda_testing::expect_close(actual.gradients, expected.gradients, gradient_tolerance,
                             cuda_testing::kGradientNormFloor, preset + " gradients");
}

TEST(CudaGpt2, TinyForwardAndBackwardOnCuda0EqualTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  expect_gpu_equals_cpu("gpt2-tiny", 4, 32, cuda_testing::kTinyForwardTolerance,
                        cuda_testing::kTinyGradientTolerance);
}

// The real shapes: 12 blocks of width 768 and the tied 50257-row head.
TEST(CudaGpt2, Gpt2124MForwardAndBackwardOnCuda0EqualTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  expect_gpu_equals_cpu("gpt2", 2, 64, cuda_testing::kGpt2ForwardTolerance, cuda_testing::kGpt2GradientTolerance);
}

// bf16 autocast: matmuls in bf16 (8-bit mantissa), layer norm, softmax statistics and loss in
// fp32: the loss within 2% of fp32's, every gradient finite, weights and gradients still fp32.
TEST(CudaGpt2, Bf16AutocastStaysNearFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  cuda_testing::ieee_fp32_matmuls();
  const model::GPT2Config config = cuda_testing::config_of("gpt2-tiny", 0, 0.0);
  const data::Batch batch = cuda_testing::make_batches(config, 1, 4, 32).front();
  model::GPT2LMHeadModel model = cuda_testing::make_model(config);
  const c10::Device cuda(c10::kCUDA, 0);
  model->to(cuda);
  const Pass fp32 = forward_backward(model, batch, cuda);
  const Pass bf16 = forward_backward(model, batch, cuda, model::Precision::kBf16);
  EXPECT_EQ(bf16.loss.scalar_type(), torch::kFloat32);
  EXPECT_LE(cuda_testing::relative_error(bf16.loss, fp32.loss), 2e-2);
  for (const auto& [name, grad] : bf16.gradients) {
    EXPECT_EQ(grad.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::isfinite(grad).all().item<bool>()) << name;
  }
}

// data::Batch::to: pinned host memory and a non_blocking copy; the values arrive intact.
TEST(CudaGpt2, BatchCopiedToTheGpuArrivesIntact) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const model::GPT2Config config = cuda_testing::config_of("gpt2-tiny", 0, 0.0);
  const data::Batch batch = cuda_testing::make_batches(config, 1, 8, 40).front();
  const data::Batch moved = batch.to(c10::Device(c10::kCUDA, 0));
  ASSERT_TRUE(moved.input_ids.is_cuda());
  ASSERT_TRUE(moved.label_token_weights.is_cuda());
  EXPECT_TRUE(torch::equal(moved.input_ids.cpu(), batch.input_ids));
  EXPECT_TRUE(torch::equal(moved.labels.cpu(), batch.labels));
  EXPECT_TRUE(torch::equal(moved.label_token_weights.cpu(), batch.label_token_weights));
}

}  // namespace
}  // namespace harness
