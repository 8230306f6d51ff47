// Shared by the CUDA tier (tests/cuda): small GPT-2 configs and batches, gradient snapshots,
// relative errors with the tolerances the tier states, and multi-process scenarios in which this
// test binary re-runs itself as the ranks (CudaWorker.Run plays the scenario named by
// HARNESS_CUDA_TEST_WORKER). Every case skips with its reason where its hardware is missing.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../support/after_adamw.h"
#include "../support/multi_process.h"
#include "harness/data/collate.h"
#include "harness/data_parallel/launcher.h"
#include "harness/model/config.h"
#include "harness/model/gpt2.h"

namespace harness::cuda_testing {

// fp32 tolerances of the tier, as relative errors |a - b| / max(|b|, floor) of whole tensors:
// the GPU and the CPU sum in different orders (cuBLAS tiles, split-K, SDPA kernels), so results
// agree to rounding, not bit for bit. TF32 is switched off (kIeeeMatmuls) so fp32 means fp32.
constexpr double kTinyForwardTolerance = 1e-5;   // logits, loss: gpt2-tiny (2 blocks, width 64)
constexpr double kTinyGradientTolerance = 1e-4;  // each parameter's gradient: gpt2-tiny
constexpr double kGpt2ForwardTolerance = 1e-4;   // logits, loss: gpt2 (124M, 12 blocks, width 768)
constexpr double kGpt2GradientTolerance = 1e-3;  // each parameter's gradient: gpt2 (124M)
// Same GPU, another split of the work (pipeline stages, micro-batches, data-parallel halves): other
// matmul shapes round differently, and CUDA's embedding and attention backward accumulate with
// atomics in any order, so runs agree to rounding: 1e-4 where the CPU tier asks 1e-5.
constexpr double kSameDeviceLossTolerance = 1e-4;
constexpr double kSameDeviceGradientTolerance = 1e-4;
// Weights after AdamW: a fraction of the steps' update (tests/support/after_adamw.h), 1e-3 as on the
// CPU tier, the atomics' noise being what AdamW scales either way.
constexpr double kSameDeviceWeightTolerance = 1e-3;
// A gradient whose norm is below this counts as zero-sized for the relative error: the key third of
// c_attn.bias has gradient 0 up to rounding (softmax ignores a per-query constant), so its
// "relative" error is rounding over rounding.
constexpr double kGradientNormFloor = 1e-3;

inline const std::string kWorkerVariable = test_workers::kWorkerVariable;

inline int gpu_count() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

// No TF32 in fp32 matmuls and convolutions (PyTorch's default for matmuls, stated here so that
// the tolerances above do not depend on it).
inline void ieee_fp32_matmuls() { at::globalContext().setFloat32MatmulPrecision("highest"); }

// |a - b| / max(|b|, floor), both moved to the CPU in float64.
inline double relative_error(const at::Tensor& a, const at::Tensor& b, double floor = 1e-12) {
  const at::Tensor x = a.detach().to(torch::kCPU, torch::kFloat64);
  const at::Tensor y = b.detach().to(torch::kCPU, torch::kFloat64);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), floor);
}

// The preset `name` with `n_layer` blocks (0: the preset's) and every dropout `dropout`.
inline model::GPT2Config config_of(const std::string& name, int64_t n_layer, double dropout) {
  model::GPT2Config config = model::GPT2Config::preset(name);
  if (n_layer > 0) config.n_layer = n_layer;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = dropout;
  return config;
}

// A model of `config` initialised from seed 1234 on the CPU (the same weights for every caller).
inline model::GPT2LMHeadModel make_model(const model::GPT2Config& config) {
  torch::manual_seed(1234);
  return model::GPT2LMHeadModel(config);
}

// `count` CPU batches of `rows` x `tokens` random ids, seeded; weights all ones when `uniform`
// (data-parallel halves then weigh the same, so their mean gradient is the whole batch's).
inline std::vector<data::Batch> make_batches(const model::GPT2Config& config, int count, int64_t rows,
                                             int64_t tokens, bool uniform = false) {
  torch::manual_seed(99);
  std::vector<data::Batch> batches;
  for (int k = 0; k < count; ++k) {
    data::Batch b;
    b.input_ids = torch::randint(config.vocab_size, {rows, tokens}, torch::kLong);
    b.labels = torch::randint(config.vocab_size, {rows, tokens}, torch::kLong);
    b.label_token_weights = uniform ? torch::ones({rows, tokens})
                                    : (torch::rand({rows, tokens}) > 0.3).to(torch::kFloat32);
    batches.push_back(b);
  }
  return batches;
}

// Rows [begin, end) of a batch.
inline data::Batch rows_of(const data::Batch& batch, int64_t begin, int64_t end) {
  data::Batch part;
  part.input_ids = batch.input_ids.slice(0, begin, end);
  part.labels = batch.labels.slice(0, begin, end);
  part.label_token_weights = batch.label_token_weights.slice(0, begin, end);
  return part;
}

inline data::Batch on_device(const data::Batch& batch, const c10::Device& device) {
  data::Batch moved;
  moved.input_ids = batch.input_ids.to(device);
  moved.labels = batch.labels.to(device);
  moved.label_token_weights = batch.label_token_weights.to(device);
  return moved;
}

using Snapshot = std::map<std::string, at::Tensor>;

// Every parameter's gradient (those that have one), copied to the CPU.
inline Snapshot gradients_of(torch::nn::Module& module) {
  Snapshot out;
  for (const auto& p : module.named_parameters()) {
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().detach().to(torch::kCPU).clone();
  }
  return out;
}

inline Snapshot weights_of(torch::nn::Module& module) {
  Snapshot out;
  for (const auto& p : module.named_parameters()) out[p.key()] = p.value().detach().to(torch::kCPU).clone();
  return out;
}

// Every tensor of `expected` present in `actual` within `tolerance` (relative, norm floor `floor`).
inline void expect_close(const Snapshot& actual, const Snapshot& expected, double tolerance, double floor,
                         const std::string& label) {
  ASSERT_EQ(actual.size(), expected.size()) << label;
  for (const auto& [name, tensor] : expected) {
    ASSERT_TRUE(actual.count(name)) << label << ": no " << name;
    EXPECT_LE(relative_error(actual.at(name), tensor, floor), tolerance) << label << ": " << name;
  }
}

// Weights after `run`'s AdamW steps, as AdamW guarantees (tests/support/after_adamw.h): each
// tensor's difference within `tolerance` of the steps' update, every element within what the
// steps can move it; the key
// third of each c_attn.bias (its gradient is 0 up to rounding, which AdamW normalises) to the
// element-wise bound only.
inline void expect_same_weights(const Snapshot& actual, const Snapshot& expected, int64_t n_embd,
                                const test_support::AdamWSteps& run, double tolerance, const std::string& label) {
  test_support::expect_weights_agree_after_adamw(actual, expected, n_embd, run, tolerance, label);
}

// Runs `world_size` copies of this test binary as the ranks of `scenario` (CudaWorker.Run) with
// the one multi-process harness (tests/support/multi_process.h): every rank must also print
// "scenario <name> passed on rank <r>". A rank silent for 120 s (a hung NCCL call) fails the run.
inline test_workers::CapturedLaunch run_scenario(const std::string& scenario, int world_size) {
  return test_workers::launch_test_workers(
      "cuda_tests", "CudaWorker.Run", scenario, world_size, {}, std::chrono::seconds(5),
      [](data_parallel::LaunchOptions& options) { options.unresponsive_worker_timeout = std::chrono::seconds(120); });
}

}  // namespace harness::cuda_testing
