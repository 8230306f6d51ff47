// GPT-2 against a Hugging Face reference dump (logits, loss, every gradient), plus the KV cache,
// placement over devices, dropout modes and the parameter count of the gpt2 preset.
#include "harness/model/gpt2.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "harness/model/safetensors.h"

namespace harness::model {
namespace {

const std::string kFixture = std::string(HARNESS_FIXTURES_DIR) + "/gpt2_tiny";

std::map<std::string, torch::Tensor> references() {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : read_safetensors(kFixture + "/references.safetensors")) out[name] = t;
  return out;
}

// SPEC §3: per-token cross entropy weighted by label_token_weights, over the sum of weights.
torch::Tensor weighted_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                            const torch::Tensor& weights) {
  auto ce = torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (ce * weights.reshape({-1})).sum() / weights.sum();
}

// max|a - b| <= rtol * max|b| + atol, reported with the numbers.
::testing::AssertionResult close(const torch::Tensor& a, const torch::Tensor& b, double rtol = 1e-5,
                                 double atol = 1e-7) {
  if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << "shapes differ: " << a.sizes() << " vs " << b.sizes();
  const double err = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  const double scale = b.abs().max().item<double>();
  if (err <= rtol * scale + atol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max|a-b| = " << err << " > " << rtol << " * max|b| (" << scale
                                       << ") + " << atol;
}

GPT2LMHeadModel fixture_model() {
  auto model = from_pretrained(kFixture);
  model->eval();
  return model;
}

TEST(GPT2ParityTest, LogitsLossAndEveryGradientMatchHuggingFace) {
  auto refs = references();
  auto model = fixture_model();
  auto input_ids = refs.at("input_ids").to(torch::kLong);
  auto labels = refs.at("labels").to(torch::kLong);
  auto weights = refs.at("label_token_weights");

  auto logits = model->forward(input_ids);
  EXPECT_TRUE(close(logits, refs.at("logits")));
  auto loss = weighted_loss(logits, labels, weights);
  EXPECT_TRUE(close(loss.reshape({1}), refs.at("loss")));
  loss.backward();

  int checked = 0;
  for (auto& item : model->named_parameters()) {
    SCOPED_TRACE(item.key());
    auto ref = refs.find("grad." + item.key());
    ASSERT_NE(ref, refs.end()) << "no reference gradient";
    ASSERT_TRUE(item.value().grad().defined());
    EXPECT_TRUE(close(item.value().grad(), ref->second));
    ++checked;
  }
  EXPECT_EQ(checked, 28);
}

TEST(GPT2ModelTest, VocabularyLogitsAreTheLinearProductWithItsGradients) {
  // The padded product for vocabularies off a multiple of 16 (1417 is IWSLT's), and the plain one.
  for (const int64_t vocab : {1417, 97, 64}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    torch::manual_seed(vocab);
    const torch::Tensor hidden = torch::randn({3, 5, 32}).requires_grad_();
    const torch::Tensor weight = torch::randn({vocab, 32}).requires_grad_();
    const torch::Tensor grad_out = torch::randn({3, 5, vocab});
    const torch::Tensor logits = vocabulary_logits(hidden, weight);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{3, 5, vocab}));
    EXPECT_TRUE(logits.is_contiguous());
    const auto grads = torch::autograd::grad({logits}, {hidden, weight}, {grad_out});
    const torch::Tensor expected = torch::linear(hidden, weight);
    const auto expected_grads = torch::autograd::grad({expected}, {hidden, weight}, {grad_out});
    EXPECT_TRUE(close(logits, expected));
    EXPECT_TRUE(close(grads[0], expected_grads[0]));
    EXPECT_TRUE(close(grads[1], expected_grads[1]));
    // Only the gradient asked for.
    const torch::Tensor fixed = weight.detach();
    const auto hidden_only = torch::autograd::grad({vocabulary_logits(hidden, fixed)}, {hidden}, {grad_out});
    EXPECT_TRUE(close(hidden_only[0], expected_grads[0]));
  }
}

TEST(GPT2ModelTest, NamedParametersAreHuggingFaceNamesAndShapes) {
  // The fixture's model.safetensors was written by transformers' save_pretrained.
  std::map<std::string, std::vector<int64_t>> hf;
  for (auto& [name, t] : read_safetensors(kFixture + "/model.safetensors")) hf[name] = t.sizes().vec();
  GPT2LMHeadModel model(GPT2Config::from_json_file(kFixture + "/config.json"));
  std::map<std::string, std::vector<int64_t>> ours;
  for (auto& item : model->named_parameters()) ours[item.key()] = item.value().sizes().vec();
  EXPECT_EQ(ours, hf);
  EXPECT_EQ(ours.count("lm_head.weight"), 0u);
  EXPECT_EQ(ours.at("transformer.h.1.attn.c_attn.weight"), (std::vector<int64_t>{32, 96}));
}

TEST(GPT2ModelTest, Gpt2PresetHas124439808Parameters) {
  GPT2LMHeadModel model(GPT2Config::preset("gpt2"));
  EXPECT_EQ(count_parameters(*model), 124439808);
}

TEST(GPT2ModelTest, ResetParametersFollowsHuggingFaceInit) {
  auto config = GPT2Config::preset("gpt2-mini");
  torch::manual_seed(0);
  GPT2LMHeadModel model(config);
  auto p = model->named_parameters();
  EXPECT_TRUE(torch::all(p["transformer.h.0.ln_1.weight"] == 1).item<bool>());
  EXPECT_TRUE(torch::all(p["transformer.h.0.attn.c_attn.bias"] == 0).item<bool>());
  EXPECT_NEAR(p["transformer.wte.weight"].std().item<double>(), 0.02, 1e-3);
  EXPECT_NEAR(p["transformer.h.0.mlp.c_proj.weight"].std().item<double>(), 0.02 / std::sqrt(8.0), 1e-3);
  torch::manual_seed(0);
  GPT2LMHeadModel again(config);
  EXPECT_TRUE(torch::equal(again->named_parameters()["transformer.wte.weight"], p["transformer.wte.weight"]));
}

TEST(GPT2ModelTest, KVCacheGenerationEqualsFullRecompute) {
  torch::NoGradGuard no_grad;
  auto model = fixture_model();
  auto ids = references().at("input_ids").to(torch::kLong);  // [3, 12]
  auto full = model->forward(ids);

  // A prompt of 5, then one token at a time: each step costs one position.
  KVCache cache;
  std::vector<torch::Tensor> pieces{model->forward_cached(ids.slice(1, 0, 5), cache)};
  EXPECT_EQ(cache.length(), 5);
  for (int64_t t = 5; t < 12; ++t) {
    pieces.push_back(model->forward_cached(ids.slice(1, t, t + 1), cache));
    EXPECT_EQ(cache.length(), t + 1);
    EXPECT_EQ(cache.layers[0].key.size(2), t + 1);
  }
  EXPECT_TRUE(close(torch::cat(pieces, 1), full));

  // Chunks longer than one token after a cache exists need the shifted causal mask.
  KVCache chunked;
  auto a = model->forward_cached(ids.slice(1, 0, 4), chunked);
  auto b = model->forward_cached(ids.slice(1, 4, 9), chunked);
  auto c = model->forward_cached(ids.slice(1, 9, 12), chunked);
  EXPECT_TRUE(close(torch::cat({a, b, c}, 1), full));
}

TEST(GPT2ModelTest, ParallelizeOverTwoCpuDevicesGivesTheSameLogits) {
  auto model = fixture_model();
  auto ids = references().at("input_ids").to(torch::kLong);
  auto before = model->forward(ids).detach();
  model->parallelize({Device::cpu(0), Device::cpu(1)});
  EXPECT_EQ(model->block_devices(), (std::vector<Device>{Device::cpu(0), Device::cpu(1)}));
  EXPECT_EQ(model->first_device(), Device::cpu(0));
  EXPECT_EQ(model->last_device(), Device::cpu(1));
  EXPECT_TRUE(torch::equal(model->forward(ids), before));

  GPT2LMHeadModel seven([] { auto c = GPT2Config::preset("gpt2-tiny"); c.n_layer = 7; return c; }());
  seven->parallelize({Device::cpu(0), Device::cpu(1), Device::cpu(2)});  // runs of 3: 3, 3, 1
  EXPECT_EQ(seven->block_devices(),
            (std::vector<Device>{Device::cpu(0), Device::cpu(0), Device::cpu(0), Device::cpu(1),
                                 Device::cpu(1), Device::cpu(1), Device::cpu(2)}));
}

TEST(GPT2ModelTest, ParallelizeRejectsADeviceWithoutABlock) {
  auto c = GPT2Config::preset("gpt2-tiny");
  c.n_layer = 12;
  GPT2LMHeadModel model(c);
  std::vector<Device> five;
  for (int i = 0; i < 5; ++i) five.push_back(Device::cpu(i));
  try {
    model->parallelize(five);  // runs of 3 fill only 4 devices
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("n_layer 12"), std::string::npos) << msg;
    EXPECT_NE(msg.find("5 devices"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cpu:4"), std::string::npos) << msg;
  }
}

TEST(GPT2ModelTest, BlocksExecutorReplacesTheSequentialWalk) {
  auto model = fixture_model();
  auto ids = references().at("input_ids").to(torch::kLong);
  auto expected = model->forward(ids).detach();
  int calls = 0;
  model->set_blocks_executor([&](const torch::Tensor& x) {
    ++calls;
    auto h = x;
    for (size_t i = 0; i < model->transformer->h->size(); ++i) h = model->transformer->h->ptr<GPT2BlockImpl>(i)->forward(h);
    return h;
  });
  EXPECT_TRUE(torch::equal(model->forward(ids), expected));
  EXPECT_EQ(calls, 1);
  model->set_blocks_executor(nullptr);
  model->forward(ids);
  EXPECT_EQ(calls, 1);
}

TEST(GPT2ModelTest, DropoutIsActiveInTrainingAndOffInEval) {
  auto c = GPT2Config::preset("gpt2-tiny");
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = 0.1;
  GPT2LMHeadModel model(c);
  auto ids = torch::randint(0, c.vocab_size, {2, 16}, torch::kLong);
  model->eval();
  auto e1 = model->forward(ids), e2 = model->forward(ids);
  EXPECT_TRUE(torch::equal(e1, e2));
  model->train();
  auto t1 = model->forward(ids), t2 = model->forward(ids);
  EXPECT_FALSE(torch::equal(t1, t2));
  EXPECT_FALSE(torch::equal(t1, e1));
  torch::manual_seed(5);
  auto r1 = model->forward(ids);
  torch::manual_seed(5);
  EXPECT_TRUE(torch::equal(model->forward(ids), r1));  // seeded dropout is reproducible
}

TEST(GPT2ModelTest, BadInputsGiveClearErrors) {
  auto model = fixture_model();
  EXPECT_THROW(model->forward(torch::zeros({4}, torch::kLong)), std::invalid_argument);
  EXPECT_THROW(model->forward(torch::zeros({1, 33}, torch::kLong)), std::invalid_argument);  // n_positions 32
  EXPECT_THROW(model->forward(torch::full({1, 3}, 97, torch::kLong)), std::invalid_argument);
  KVCache cache;
  model->forward_cached(torch::zeros({1, 30}, torch::kLong), cache);
  EXPECT_THROW(model->forward_cached(torch::zeros({1, 3}, torch::kLong), cache), std::invalid_argument);
}

}  // namespace
}  // namespace harness::model
