// Dropout streams: with a stream installed GPT-2's dropouts draw from it and reproduce torch's CPU
// masks for the same state, the manual attention equals scaled_dot_product_attention without
// dropout, and a reseeded default generator is put back as it was.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <thread>

#include "harness/model/dropout.h"
#include "harness/model/gpt2.h"

namespace harness::model {
namespace {

TEST(Dropout, AStreamReproducesTorchsCpuMaskForTheSameState) {
  torch::nn::Dropout module(0.3);
  module->train();
  const at::Tensor x = torch::rand({64, 33}) + 1.0;
  torch::manual_seed(7);
  const at::Tensor expected = module(x);
  {
    torch::manual_seed(99);  // the default generator is not what the scope draws from
    DropoutGeneratorScope scope(make_generator(c10::kCPU, 7));
    EXPECT_TRUE(torch::equal(dropout(x, module), expected));
  }
  // Without a stream: torch::nn::Dropout itself; in eval mode or with p = 0: the input.
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(dropout(x, module), expected));
  module->eval();
  DropoutGeneratorScope scope(make_generator(c10::kCPU, 7));
  EXPECT_TRUE(torch::equal(dropout(x, module), x));
}

TEST(Dropout, ScopesNestAndEndWithTheirThread) {
  EXPECT_FALSE(current_dropout_generator().has_value());
  {
    DropoutGeneratorScope outer(make_generator(c10::kCPU, 1));
    {
      DropoutGeneratorScope inner(make_generator(c10::kCPU, 2));
      EXPECT_EQ(current_dropout_generator()->current_seed(), 2u);
    }
    EXPECT_EQ(current_dropout_generator()->current_seed(), 1u);
    std::thread([] { EXPECT_FALSE(current_dropout_generator().has_value()); }).join();
  }
  EXPECT_FALSE(current_dropout_generator().has_value());
}

TEST(Dropout, ManualAttentionWithoutDropoutIsScaledDotProductAttention) {
  torch::manual_seed(3);
  const at::Tensor q = torch::randn({2, 4, 6, 8}), k = torch::randn({2, 4, 6, 8}), v = torch::randn({2, 4, 6, 8});
  at::Generator generator = make_generator(c10::kCPU, 1);
  const double scale = 1.0 / std::sqrt(8.0);
  EXPECT_TRUE(torch::allclose(attention_with_dropout(q, k, v, std::nullopt, true, 0.0, scale, generator),
                              at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, scale), 1e-5, 1e-6));
  // A boolean mask (as after a KV cache: 2 new queries over 6 keys) and a single query.
  const at::Tensor mask = torch::ones({2, 6}, torch::kBool).tril(4);
  const at::Tensor q2 = q.slice(2, 4, 6);
  EXPECT_TRUE(torch::allclose(attention_with_dropout(q2, k, v, mask, false, 0.0, scale, generator),
                              at::scaled_dot_product_attention(q2, k, v, mask, 0.0, false, scale), 1e-5, 1e-6));
  const at::Tensor q1 = q.slice(2, 5, 6);
  EXPECT_TRUE(torch::allclose(attention_with_dropout(q1, k, v, std::nullopt, false, 0.0, scale, generator),
                              at::scaled_dot_product_attention(q1, k, v, std::nullopt, 0.0, false, scale), 1e-5, 1e-6));
  EXPECT_THROW(attention_with_dropout(q2, k, v, std::nullopt, true, 0.0, scale, generator), c10::Error);
}

TEST(Dropout, GPT2DrawsEveryMaskFromTheStream) {
  GPT2Config config = GPT2Config::preset("gpt2-tiny");
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.2;
  torch::manual_seed(1);
  GPT2LMHeadModel model(config);
  model->train();
  const at::Tensor ids = torch::randint(config.vocab_size, {2, 12}, torch::kLong);
  auto logits_with = [&](uint64_t seed) {
    torch::manual_seed(seed + 1000);  // different default-generator state each time
    DropoutGeneratorScope scope(make_generator(c10::kCPU, seed));
    return model->forward(ids);
  };
  EXPECT_TRUE(torch::equal(logits_with(5), logits_with(5)));
  EXPECT_FALSE(torch::equal(logits_with(5), logits_with(6)));
}

TEST(Dropout, ReseedingTheDefaultGeneratorPutsItBack) {
  torch::manual_seed(11);
  const at::Tensor undisturbed = torch::rand({4});
  torch::manual_seed(11);
  const at::Tensor drawn = with_default_generator_seeded(c10::kCPU, 5, [] { return torch::rand({3}); });
  torch::manual_seed(5);
  EXPECT_TRUE(torch::equal(drawn, torch::rand({3})));
  torch::manual_seed(11);
  (void)with_default_generator_seeded(c10::kCPU, 5, [] { return torch::rand({3}); });
  EXPECT_TRUE(torch::equal(torch::rand({4}), undisturbed));
  EXPECT_THROW(with_default_generator_seeded(c10::kCPU, 5, []() -> at::Tensor { throw std::runtime_error("x"); }),
               std::runtime_error);
  torch::manual_seed(11);
  EXPECT_THROW(with_default_generator_seeded(c10::kCPU, 5, []() -> at::Tensor { throw std::runtime_error("x"); }),
               std::runtime_error);
  EXPECT_TRUE(torch::equal(torch::rand({4}), undisturbed)) << "restored after a throw too";
}

}  // namespace
}  // namespace harness::model
