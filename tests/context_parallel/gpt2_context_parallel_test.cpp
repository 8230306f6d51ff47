// GPT-2 over a context group against the plain model: a group of one in this process, and two and
// three Gloo ranks (worker_test.cpp's "gpt2" scenario).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "gpt2_check.h"
#include "test_support.h"

namespace harness::context_parallel {
namespace {

using namespace testing;

TEST(Gpt2ContextParallel, GroupOfOneMatchesThePlainModel) {
  expect_gpt2_matches_plain(std::make_shared<SoloGroup>());
}

TEST(Gpt2ContextParallel, WithoutAGroupTheModelIsUnchangedBitForBit) {
  model::GPT2Config config = model::GPT2Config::preset("gpt2-tiny");
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  torch::manual_seed(3);
  model::GPT2LMHeadModel once(config);
  torch::manual_seed(3);
  model::GPT2LMHeadModel cleared(config);
  cleared->set_context_parallel(std::make_shared<SoloGroup>());
  cleared->set_context_parallel(nullptr);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 10}, torch::kLong);
  EXPECT_TRUE(torch::equal(once->forward(ids), cleared->forward(ids)));
}

TEST(Gpt2ContextParallel, ShardLongerThanThePositionsIsRefused) {
  model::GPT2Config config = model::GPT2Config::preset("gpt2-tiny");
  model::GPT2LMHeadModel model(config);
  model->set_context_parallel(std::make_shared<SoloGroup>());
  const at::Tensor ids = torch::zeros({1, config.n_positions + 2}, torch::kLong);
  try {
    model->forward(ids);
    FAIL() << "no refusal";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds n_positions"), std::string::npos) << e.what();
  }
}

TEST(Gpt2ContextParallel, TwoRanksMatchThePlainModel) { expect_workers_pass(launch_scenario("gpt2", 2)); }

TEST(Gpt2ContextParallel, ThreeRanksMatchThePlainModel) { expect_workers_pass(launch_scenario("gpt2", 3)); }

}  // namespace
}  // namespace harness::context_parallel
