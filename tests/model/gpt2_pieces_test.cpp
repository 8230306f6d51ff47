// GPT-2's own pieces, which every layout runs: the embedding, runs of block halves and the final
// norm + tied head compose to forward() bit for bit wherever the runs are cut, their gradients
// are forward()'s, and a run outside the model's halves is refused with the numbers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "harness/model/config.h"
#include "harness/model/gpt2.h"
#include "harness/model/loss.h"

namespace harness::model {
namespace {

GPT2LMHeadModel tiny_model() {
  GPT2Config config = GPT2Config::preset("gpt2-tiny");
  config.n_layer = 3;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  torch::manual_seed(5);
  return GPT2LMHeadModel(config);
}

at::Tensor token_ids(const GPT2Config& config) {
  torch::manual_seed(6);
  return torch::randint(config.vocab_size, {2, 9}, torch::kLong);
}

TEST(GPT2Pieces, EmbedUnitsAndHeadComposeToForwardWhereverTheRunsAreCut) {
  GPT2LMHeadModel model = tiny_model();
  const at::Tensor ids = token_ids(model->config());
  torch::NoGradGuard no_grad;
  const at::Tensor whole = model->forward(ids);
  EXPECT_EQ(model->n_units(), 6);
  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, 6}, {0, 1, 6}, {0, 3, 4, 6}, {0, 2, 2, 5, 6}}) {
    at::Tensor hidden = model->embed(ids);
    for (size_t k = 0; k + 1 < cuts.size(); ++k) hidden = model->forward_units(hidden, cuts[k], cuts[k + 1]);
    const at::Tensor logits = model->head_logits(hidden, model->transformer->wte->weight);
    EXPECT_TRUE(torch::equal(logits, whole)) << "cuts ending at " << cuts[cuts.size() - 2];
  }
}

// A pipeline's last stage projects onto a copy of wte (a leaf of its own): the loss and the
// summed gradients of both copies are forward()'s.
TEST(GPT2Pieces, AHeadOnACopyOfWteGivesForwardsLossAndGradients) {
  GPT2LMHeadModel model = tiny_model();
  const at::Tensor ids = token_ids(model->config());
  const at::Tensor labels = ids.roll(1, 1);
  const at::Tensor weights = torch::ones(ids.sizes());
  const at::Tensor whole = weighted_cross_entropy(model->forward(ids), labels, weights);
  whole.backward();
  const at::Tensor want = model->transformer->wte->weight.grad().clone();
  const at::Tensor want_block = model->transformer->h->ptr<GPT2BlockImpl>(1)->mlp->c_fc->weight.grad().clone();
  model->zero_grad();
  const at::Tensor copy = model->transformer->wte->weight.detach().clone().requires_grad_(true);
  const at::Tensor hidden = model->forward_units(model->forward_units(model->embed(ids), 0, 3), 3, 6);
  const at::Tensor pieces = weighted_cross_entropy(model->head_logits(hidden, copy), labels, weights);
  pieces.backward();
  EXPECT_TRUE(torch::equal(pieces, whole));
  EXPECT_TRUE(torch::allclose(model->transformer->wte->weight.grad() + copy.grad(), want, 1e-6, 1e-8));
  EXPECT_TRUE(torch::equal(model->transformer->h->ptr<GPT2BlockImpl>(1)->mlp->c_fc->weight.grad(), want_block));
}

TEST(GPT2Pieces, ARunOutsideTheModelsHalvesIsRefused) {
  GPT2LMHeadModel model = tiny_model();
  const at::Tensor hidden = torch::zeros({1, 2, model->config().n_embd});
  for (const auto& [first, end] : {std::pair<int64_t, int64_t>{-1, 2}, {0, 7}, {4, 3}}) {
    try {
      (void)model->forward_units(hidden, first, end);
      ADD_FAILURE() << first << ", " << end;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("block halves [" + std::to_string(first) + ", " + std::to_string(end) +
                                           ") are outside the model's [0, 6)"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace harness::model
