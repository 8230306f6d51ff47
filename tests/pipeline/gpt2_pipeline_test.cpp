// GPT-2 through enable_pipeline: logits and gradients in model-parallel and pipeline mode equal
// the single-device ones (dropout off), a timing printout of the pipelined backward, and the
// default split's cost estimate against hand-worked figures and a literal table.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "harness/model/gpt2.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/gpt2_pipeline.h"

#include "test_support.h"

namespace harness::pipeline {
namespace {

using testing::error_of;

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

// The estimate's figures, worked by hand from the header's formulas: gpt2-tiny (C 64, I 256,
// V 1024) at micro-batches of 2 x 16 tokens (N = 32), an element at 64 FLOPs.
//   attention  32 x (3 x (8 x 64^2 + 2 x 64 x 17) + 64 x 25 x 64)              =  6,631,424
//   MLP        32 x (3 x 4 x 64 x 256 + 64 x (13 x 64 + 5 x 256))               = 10,616,832
//   head       32 x (3 x 2 x 64 x 1024 + 64 x (6 x 64 + 6 x 1024)) + 64 x 3 x 1024 x 64
//                                                                               = 38,535,168
//   embedding  32 x 64 x (2 x 64 + 4 x 64) + 64 x 3 x 1024 x 64                 = 13,369,344
TEST(Gpt2Cost, TheEstimateIsTheHeadersFormulas) {
  const Gpt2PieceCosts c = estimate_gpt2_costs(tiny_config(2), 2, 16);
  EXPECT_DOUBLE_EQ(c.attention, 6631424.0);
  EXPECT_DOUBLE_EQ(c.mlp, 10616832.0);
  EXPECT_DOUBLE_EQ(c.head, 38535168.0);
  EXPECT_DOUBLE_EQ(c.embedding, 13369344.0);
  // Tokens past n_positions (128) are costed at n_positions.
  const Gpt2PieceCosts capped = estimate_gpt2_costs(tiny_config(2), 1, 4096);
  const Gpt2PieceCosts at_positions = estimate_gpt2_costs(tiny_config(2), 1, 128);
  EXPECT_DOUBLE_EQ(capped.attention, at_positions.attention);
  EXPECT_THROW(estimate_gpt2_costs(tiny_config(2), 0, 16), std::invalid_argument);
}

// The same terms given to F, B and W, for gpt2-tiny's two blocks as stages {2, 2} (halves):
//   attention  F 32 x (8 x 64^2 + 2 x 64 x 17 + 64 x 1600 / 3) = 2,210,474.67
//              B 32 x (8 x 64^2 + 4 x 64 x 17 + 2 x 64 x 1600 / 3) = 3,372,373.33   W 32 x 8 x 64^2 = 1,048,576
//   MLP        F 32 x (4 x 64 x 256 + 64 x 2112 / 3) = 3,538,944
//              B 32 x (4 x 64 x 256 + 2 x 64 x 2112 / 3) = 4,980,736                W 32 x 4 x 64 x 256 = 2,097,152
//   head       F 32 x (2 x 64 x 1024 + 64 x (384 / 3 + 3 x 1024)) = 10,747,904
//              B 32 x (2 x 64 x 1024 + 64 x (2 x 384 / 3 + 3 x 1024)) = 11,010,048
//              W 32 x 2 x 64 x 1024 + 64 x 3 x 1024 x 64 = 16,777,216
//   embedding  F 32 x 64 x 384 / 3 = 262,144   B 2 x 262,144 + 12,582,912 = 13,107,200   W 0
// Stage 0 (a block and the embedding): F 6,011,562.67, B 21,460,309.33 (the largest: 1000
// ticks), W 3,145,728; stage 1 (a block and the head): F 16,497,322.67, B 19,363,157.33,
// W 19,922,944. Each stage's three add up to its gpt2_stage_costs.
TEST(Gpt2Cost, StageTicksSplitEachStagesCostIntoForwardInputAndWeightGradients) {
  const std::vector<ActionTicks> ticks = estimate_gpt2_stage_ticks(tiny_config(2), {2, 2}, 2, 16);
  ASSERT_EQ(ticks.size(), 2u);
  EXPECT_EQ(ticks[0].forward, 280);
  EXPECT_EQ(ticks[0].input_gradient, 1000);
  EXPECT_EQ(ticks[0].weight_gradient, 147);
  EXPECT_EQ(ticks[1].forward, 769);
  EXPECT_EQ(ticks[1].input_gradient, 902);
  EXPECT_EQ(ticks[1].weight_gradient, 928);

  // GPT-2 124M's stages at 8 x 128: every stage's F + B + W in the ratio of its whole cost.
  const model::GPT2Config gpt2 = model::GPT2Config::preset("gpt2");
  const std::vector<int> halves = {7, 8, 8, 1};
  const std::vector<ActionTicks> big = estimate_gpt2_stage_ticks(gpt2, halves, 8, 128);
  const std::vector<double> whole = gpt2_stage_costs(estimate_gpt2_costs(gpt2, 8, 128), halves);
  for (size_t s = 0; s < halves.size(); ++s) {
    const double sum = big[s].forward + big[s].input_gradient + big[s].weight_gradient;
    const double last = big[3].forward + big[3].input_gradient + big[3].weight_gradient;
    EXPECT_NEAR(sum / last, whole[s] / whole[3], 0.005) << "stage " << s;
  }
  // Two stages of whole blocks differ only by the embedding, which adds nothing to W.
  EXPECT_EQ(big[1].weight_gradient, big[2].weight_gradient);
  EXPECT_EQ(big[1].forward, big[2].forward);

  EXPECT_EQ(error_of([&] { estimate_gpt2_stage_ticks(tiny_config(2), {4, 0}, 2, 16); }),
            "estimate_gpt2_stage_ticks: stage 1 has 0 half blocks; every stage needs one at least");
  EXPECT_THROW(estimate_gpt2_stage_ticks(tiny_config(2), {2, 2}, 0, 16), std::invalid_argument);
}

TEST(Gpt2Cost, StageCostsAddTheHalvesTheEmbeddingAndTheHead) {
  const Gpt2PieceCosts c{1.0, 10.0, 100.0, 1000.0};  // embedding, attention, MLP, head
  EXPECT_EQ(gpt2_stage_costs(c, {3, 1}), (std::vector<double>{1 + 10 + 100 + 10, 100 + 1000}));
  EXPECT_EQ(gpt2_stage_costs(c, {4}), (std::vector<double>{1 + 220 + 1000}));
}

// The default split, as a table: the head costs several blocks wherever the vocabulary is wide
// against the width, and the last stage gets fewer half blocks to match. Micro-batches of 8 x 128.
TEST(Gpt2Cost, TheDefaultSplitAsALiteralTable) {
  auto config = [](const std::string& preset, int64_t vocab, int64_t n_layer) {
    model::GPT2Config c = model::GPT2Config::preset(preset);
    c.vocab_size = vocab;
    if (n_layer > 0) c.n_layer = n_layer;
    return c;
  };
  struct Row {
    model::GPT2Config config;
    int stages;
    std::string split;
  };
  const std::vector<Row> table = {
      {config("gpt2-mini", 8192, 4), 2, "3.5,0.5"},  // 4 blocks of width 256: the head costs 2.8 blocks
      {config("gpt2-mini", 8192, 4), 4, "1,1,1.5,0.5"},
      {config("gpt2", 50257, 0), 2, "9,3"},  // GPT-2 124M: the head costs 5.6 blocks
      {config("gpt2", 50257, 0), 4, "3.5,4,4,0.5"},
      {config("gpt2", 1417, 0), 2, "6,6"},  // a narrow vocabulary: the head costs 0.16 blocks
      {config("gpt2", 1417, 0), 4, "3,3,3,3"},
      {config("gpt2-mini", 1417, 0), 2, "2.5,1.5"},
      {config("gpt2-mini", 4096, 0), 4, "1,1,1.5,0.5"},
  };
  for (const Row& row : table) {
    EXPECT_EQ(format_halves(balance_gpt2_by_cost(row.config, row.stages, 8, 128)), row.split)
        << "n_layer " << row.config.n_layer << ", n_embd " << row.config.n_embd << ", vocab "
        << row.config.vocab_size << ", " << row.stages << " stages";
  }
  // gpt2-tiny's 2 blocks over 4 stages: a half block each, where SPEC's runs leave stages empty.
  EXPECT_EQ(format_halves(balance_gpt2_by_cost(tiny_config(2), 4, 8, 128)), "0.5,0.5,0.5,0.5");
  EXPECT_THROW(balance_gpt2_by_cost(tiny_config(2), 5, 8, 128), std::invalid_argument);
}

// zbv's default split: the devices' split where its order idles less on the estimated ticks.
TEST(Gpt2Cost, TheZbvSplitEvensTheDevicesWhereItsOrderIdlesLess) {
  auto config = [](const std::string& preset, int64_t vocab) {
    model::GPT2Config c = model::GPT2Config::preset(preset);
    c.vocab_size = vocab;
    return c;
  };
  struct Row {
    model::GPT2Config config;
    int devices, micro_batches;
    std::string split;
  };
  const std::vector<Row> table = {
      // gpt2-mini: with 4 micro-batches the stages' split (devices 192 and 166 ms a micro-batch
      // timed) still idles less than the devices' (178 and 181, but stages of 30 to 148)...
      {config("gpt2-mini", 4096), 2, 4, "1,1,1.5,0.5"},
      // ...and with 8, whose steady state is longer, the devices' does.
      {config("gpt2-mini", 4096), 2, 8, "0.5,1,1.5,1"},
      // GPT-2 124M: the head's 5.6 blocks make the stages' split leave device 1 idle.
      {config("gpt2", 50257), 2, 4, "2.5,4.5,4.5,0.5"},
      {config("gpt2", 50257), 2, 8, "2.5,4.5,4.5,0.5"},
      // One split only: a half block a stage.
      {tiny_config(2), 2, 4, "0.5,0.5,0.5,0.5"},
  };
  for (const Row& row : table) {
    EXPECT_EQ(format_halves(balance_gpt2_for_zbv(row.config, row.devices, row.micro_batches, 8, 128)), row.split)
        << "n_layer " << row.config.n_layer << ", vocab " << row.config.vocab_size << ", D " << row.devices << ", M "
        << row.micro_batches;
  }
  // Where the devices' split would take more than kZbvSplitsSearched splits to find (gpt2-medium's
  // 48 halves over 8 stages: 62,891,499), the stages' split stands.
  const model::GPT2Config medium = config("gpt2-medium", 50257);
  EXPECT_EQ(balance_gpt2_for_zbv(medium, 4, 8, 8, 128), balance_gpt2_by_cost(medium, 8, 8, 128));
  EXPECT_THROW(balance_gpt2_for_zbv(tiny_config(2), 3, 6, 8, 128), std::invalid_argument);
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
