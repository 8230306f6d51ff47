// GPT-2 through enable_pipeline: logits and gradients in model-parallel and pipeline mode equal
// the single-device ones (dropout off), and a timing printout of the pipelined backward.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "harness/model/gpt2.h"
#include "harness/pipeline/gpt2_pipeline.h"

namespace harness::pipeline {
namespace {

model::GPT2Config tiny_config(int64_t n_layer) {
  model::GPT2Config config = model::GPT2Config::preset("gpt2-tiny");
  config.n_layer = n_layer;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  return config;
}

model::GPT2LMHeadModel make_model(const model::GPT2Config& config) {
  torch::manual_seed(1234);
  return model::GPT2LMHeadModel(config);
}

struct Result {
  torch::Tensor logits;
  std::map<std::string, torch::Tensor> grads;
};

Result run_step(model::GPT2LMHeadModel& model, const torch::Tensor& ids, const torch::Tensor& labels) {
  model->zero_grad();
  Result result;
  result.logits = model->forward(ids);
  torch::nn::functional::cross_entropy(result.logits.flatten(0, 1), labels.flatten())
      .backward();
  for (const auto& p : model->named_parameters()) {
    if (p.value().grad().defined()) result.grads[p.key()] = p.value().grad().clone();
  }
  return result;
}

void expect_same(const Result& actual, const Result& expected, const std::string& mode) {
  EXPECT_TRUE(torch::allclose(actual.logits, expected.logits, 1e-5, 1e-5)) << mode << ": logits";
  ASSERT_EQ(actual.grads.size(), expected.grads.size()) << mode;
  for (const auto& [name, grad] : expected.grads) {
    ASSERT_TRUE(actual.grads.count(name)) << mode << ": no gradient for " << name;
    EXPECT_TRUE(torch::allclose(actual.grads.at(name), grad, 1e-5, 1e-6)) << mode << ": " << name;
  }
}

class Gpt2Pipeline : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = tiny_config(4);
    torch::manual_seed(7);
    ids_ = torch::randint(config_.vocab_size, {6, 16}, torch::kLong);
    labels_ = torch::randint(config_.vocab_size, {6, 16}, torch::kLong);
    model::GPT2LMHeadModel reference = make_model(config_);
    expected_ = run_step(reference, ids_, labels_);
  }
  model::GPT2Config config_;
  torch::Tensor ids_, labels_;
  Result expected_;
  const std::vector<Device> lanes_ = {Device::cpu(0), Device::cpu(1)};
};

TEST_F(Gpt2Pipeline, a5_2_2_ModelParallelOnLanesEqualsSingleDevice) {
  model::GPT2LMHeadModel model = make_model(config_);
  auto pipe = enable_pipeline(model, lanes_, /*split_size=*/ids_.size(0), {1});
  EXPECT_EQ(pipe->devices(), lanes_);
  EXPECT_EQ(pipe->partitions()[0]->size(), 2u);
  expect_same(run_step(model, ids_, labels_), expected_, "model parallel");
}

TEST_F(Gpt2Pipeline, a5_2_2_PipelineEqualsSingleDevice) {
  for (int64_t n_chunk : {2, 4}) {
    for (bool pipelined_backward : {true, false}) {
      model::GPT2LMHeadModel model = make_model(config_);
      PipeOptions options;
      options.threads_per_device = 1;
      options.pipelined_backward = pipelined_backward;
      const int64_t split = (ids_.size(0) + n_chunk - 1) / n_chunk;
      auto pipe = enable_pipeline(model, lanes_, split, options);
      expect_same(run_step(model, ids_, labels_), expected_,
                  "pipeline n_chunk " + std::to_string(n_chunk) +
                      (pipelined_backward ? " (pipelined backward)" : " (engine backward)"));
    }
  }
}

TEST_F(Gpt2Pipeline, ExecutorFailsClearlyOnceThePipeIsGoneAndCanBeDisabled) {
  model::GPT2LMHeadModel model = make_model(config_);
  enable_pipeline(model, lanes_, 3, {1});  // the returned Pipe is dropped at once
  try {
    model->forward(ids_);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("keep the returned pointer alive"), std::string::npos);
  }
  disable_pipeline(model);
  EXPECT_TRUE(torch::allclose(model->forward(ids_), expected_.logits, 1e-5, 1e-5));
}

// Not a pass/fail speed check (the machine is shared): prints the step time of one micro-batch
// (model parallel on the lanes) against 4 micro-batches with the engine's and with the pipelined
// backward, two lanes with one intra-op thread each. About 20 s, so only with
// HARNESS_PIPE_TIMING=1 in the environment.
TEST(Gpt2PipelineTiming, PrintsModelParallelVersusPipeline) {
  if (std::getenv("HARNESS_PIPE_TIMING") == nullptr) {
    GTEST_SKIP() << "set HARNESS_PIPE_TIMING=1 to print the pipeline timing";
  }
  model::GPT2Config config = tiny_config(4);
  config.n_embd = 256;
  config.n_inner = 0;
  config.n_head = 4;
  const int64_t batch = 16, seq = 64;
  torch::manual_seed(3);
  const auto ids = torch::randint(config.vocab_size, {batch, seq}, torch::kLong);
  const auto labels = torch::randint(config.vocab_size, {batch, seq}, torch::kLong);
  const std::vector<Device> lanes = {Device::cpu(0), Device::cpu(1)};
  auto time_step = [&](int64_t split, bool pipelined_backward) {
    model::GPT2LMHeadModel model = make_model(config);
    PipeOptions options;
    options.threads_per_device = 1;
    options.pipelined_backward = pipelined_backward;
    auto pipe = enable_pipeline(model, lanes, split, options);
    double best = 1e30;
    for (int rep = 0; rep < 4; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      run_step(model, ids, labels);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (rep > 0) best = std::min(best, seconds);
    }
    return best;
  };
  const double model_parallel = time_step(batch, true);
  const double pipeline_engine = time_step(batch / 4, false);
  const double pipeline = time_step(batch / 4, true);
  std::printf("[timing] GPT-2 %lld layers x %lld wide, batch %lld x %lld, 2 lanes x 1 thread, best of 3 steps:\n"
              "[timing]   model parallel (1 micro-batch)            %.3f s\n"
              "[timing]   pipeline, 4 micro-batches, engine backward %.3f s (%.2fx)\n"
              "[timing]   pipeline, 4 micro-batches, pipelined bwd   %.3f s (%.2fx)\n",
              static_cast<long long>(config.n_layer), static_cast<long long>(config.n_embd),
              static_cast<long long>(batch), static_cast<long long>(seq), model_parallel,
              pipeline_engine, model_parallel / pipeline_engine, pipeline, model_parallel / pipeline);
  EXPECT_GT(pipeline, 0.0);
}

}  // namespace
}  // namespace harness::pipeline

namespace harness::pipeline {
namespace {

// Two blocks over two stages cut as 1.5 and 0.5 blocks, half blocks [0, 3) and [3, 4): block 0 and
// block 1's attention on stage 0, block 1's MLP and ln_f on stage 1; wte on both (the tied head).
TEST(Gpt2StageOfParameter, EachParameterGoesWithItsBlockHalfAsALiteralTable) {
  const std::vector<int64_t> first = {0, 3, 4};
  const std::vector<std::pair<std::string, int>> expected = {
      {"transformer.wte.weight", 0},          {"transformer.wpe.weight", 0},
      {"transformer.h.0.ln_1.weight", 0},     {"transformer.h.0.attn.c_attn.weight", 0},
      {"transformer.h.0.mlp.c_proj.bias", 0}, {"transformer.h.1.ln_1.bias", 0},
      {"transformer.h.1.attn.c_proj.weight", 0}, {"transformer.h.1.ln_2.weight", 1},
      {"transformer.h.1.mlp.c_fc.weight", 1}, {"transformer.ln_f.bias", 1}};
  for (const auto& [name, stage] : expected) EXPECT_EQ(gpt2_stage_of_parameter(name, first), stage) << name;
  EXPECT_TRUE(stage_holds_gpt2_parameter(1, "transformer.wte.weight", first));
  EXPECT_TRUE(stage_holds_gpt2_parameter(0, "transformer.wte.weight", first));
  EXPECT_FALSE(stage_holds_gpt2_parameter(1, "transformer.wpe.weight", first));
  EXPECT_FALSE(stage_holds_gpt2_parameter(0, "transformer.ln_f.weight", first));
  try {
    gpt2_stage_of_parameter("transformer.h.2.mlp.c_fc.weight", first);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("block half 5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gpt2_stage_of_parameter("lm_head.weight", first), std::invalid_argument);
}

}  // namespace
}  // namespace harness::pipeline
