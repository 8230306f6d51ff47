// Shared by the train tests: a small GPT-2, and the gradients and weights of two training runs
// compared.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

#include "../support/after_adamw.h"
#include "harness/model/gpt2.h"
#include "harness/pipeline/executor.h"
#include "harness/train/step/train_step.h"

namespace harness::train::testing {

// One way to run the pipeline training step: schedule, virtual stages per device, micro-batches
// and activation checkpointing (the train and CUDA tiers walk lists of them).
struct Layout {
  pipeline::ScheduleKind schedule;
  int virtual_stages;
  int micro_batches;
  pipeline::ActivationCheckpointing checkpointing;
  std::string name() const {
    return pipeline::to_string(schedule) + " V=" + std::to_string(virtual_stages) + " M=" + std::to_string(micro_batches) + " " +
           pipeline::to_string(checkpointing);
  }
};

// gpt2-tiny with `n_layer` blocks and every dropout `dropout`.
inline model::GPT2Config tiny_config(int64_t n_layer, double dropout) {
  model::GPT2Config config = model::GPT2Config::preset("gpt2-tiny");
  config.n_layer = n_layer;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = dropout;
  return config;
}

// A model of `config` initialised from seed 1234 (the same weights for every caller).
inline model::GPT2LMHeadModel make_model(const model::GPT2Config& config) {
  torch::manual_seed(1234);
  return model::GPT2LMHeadModel(config);
}

// The step's last gradients (unsplit_gradients) and current weights, by name.
inline std::map<std::string, at::Tensor> gradients_of(TrainStep& step) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, grad] : step.unsplit_gradients()) out[name] = grad;
  return out;
}

inline std::map<std::string, at::Tensor> weights_of(TrainStep& step) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : step.model()->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// |a - b| / |b| (|b| at least 1e-12).
inline double relative(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).norm() / b.norm().clamp_min(1e-12)).item<double>();
}

// Every weight of `actual` against `expected`'s after `run`'s AdamW steps, as AdamW guarantees
// (tests/support/after_adamw.h): each tensor's difference within `tolerance` of the steps' update
// (lr * steps * sqrt(n)), every element within
// what the steps can move it. The key third of each c_attn.bias is held to the element-wise bound
// only: it adds q_i . b_k to every score of query i, which softmax ignores, so its gradient is 0
// up to rounding (checked here against `expected_first_gradients`), and AdamW divides that
// rounding by its own square root.
inline void expect_same_weights(const std::map<std::string, at::Tensor>& actual,
                                const std::map<std::string, at::Tensor>& expected,
                                const std::map<std::string, at::Tensor>& expected_first_gradients,
                                int64_t n_embd, const test_support::AdamWSteps& run, double tolerance,
                                const std::string& label) {
  for (const auto& [name, grad] : expected_first_gradients) {
    if (name.find("attn.c_attn.bias") == std::string::npos) continue;
    EXPECT_LT(grad.slice(0, n_embd, 2 * n_embd).abs().max().item<double>(), 1e-7) << label << ": " << name;
  }
  test_support::expect_weights_agree_after_adamw(actual, expected, n_embd, run, tolerance, label);
}

}  // namespace harness::train::testing
