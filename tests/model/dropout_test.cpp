// Dropout streams: with a stream installed GPT-2's dropouts draw from it, the same state giving the
// same masks; the CPU keep mask is Bernoulli(1 - p) scaled, whatever the thread count; the manual
// attention equals scaled_dot_product_attention without dropout; a reseeded default generator is
// put back as it was.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>

#include "harness/model/dropout.h"
#include "harness/model/gpt2.h"

namespace harness::model {
namespace {

TEST(Dropout, AStreamGivesTheSameMaskForTheSameStateAndTheDefaultGeneratorServesWithoutOne) {
  torch::nn::Dropout module(0.3);
  module->train();
  const at::Tensor x = torch::rand({64, 33}) + 1.0;
  auto with_stream = [&](uint64_t seed) {
    torch::manual_seed(seed + 99);  // the default generator is not what the scope draws from
    DropoutGeneratorScope scope(make_generator(c10::kCPU, seed));
    return dropout(x, module);
  };
  EXPECT_TRUE(torch::equal(with_stream(7), with_stream(7)));
  EXPECT_FALSE(torch::equal(with_stream(7), with_stream(8)));
  // Without a stream, CPU masks come from the default generator, one draw per mask.
  torch::manual_seed(7);
  const at::Tensor first = dropout(x, module), second = dropout(x, module);
  EXPECT_FALSE(torch::equal(first, second));
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(dropout(x, module), first));
  EXPECT_TRUE(torch::equal(dropout(x, module), second));
  // The values: x / (1 - p) where kept, 0 where dropped.
  const at::Tensor kept = first != 0;
  EXPECT_TRUE(torch::allclose(first.masked_select(kept), x.masked_select(kept) / 0.7));
  // In eval mode or with p = 0: the input.
  module->eval();
  DropoutGeneratorScope scope(make_generator(c10::kCPU, 7));
  EXPECT_TRUE(torch::equal(dropout(x, module), x));
}

TEST(Dropout, KeepMaskIsBernoulliScaledWhateverTheThreadCount) {
  const at::Tensor like = torch::empty({1000, 1000});
  const int threads = at::get_num_threads();
  at::Generator generator = make_generator(c10::kCPU, 3);
  at::set_num_threads(1);
  const at::Tensor one_thread = dropout_keep_mask(like, 0.3, generator);
  const at::Tensor next = dropout_keep_mask(like, 0.3, generator);
  generator = make_generator(c10::kCPU, 3);
  at::set_num_threads(2);
  const at::Tensor two_threads = dropout_keep_mask(like, 0.3, generator);
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one_thread, two_threads));
  EXPECT_FALSE(torch::equal(one_thread, next)) << "the generator advances";

  const at::Tensor keep = one_thread != 0;
  EXPECT_TRUE(torch::all(one_thread.masked_select(keep) == static_cast<float>(1.0 / 0.7)).item<bool>());
  // 10^6 draws: a kept fraction's standard deviation is 4.6e-4; 0.003 is more than 6 of them.
  const auto fraction = [](const at::Tensor& t) { return t.to(torch::kDouble).mean().item<double>(); };
  EXPECT_NEAR(fraction(keep), 0.7, 0.003);
  const at::Tensor flat = keep.view(-1);
  const at::Tensor even = flat.slice(0, 0, std::nullopt, 2), odd = flat.slice(0, 1, std::nullopt, 2);
  EXPECT_NEAR(fraction(even), 0.7, 0.004);  // the two halves of each 64-bit draw
  EXPECT_NEAR(fraction(odd), 0.7, 0.004);
  EXPECT_NEAR(fraction(even & odd), 0.49, 0.004) << "neighbours are independent";
  EXPECT_NEAR(fraction(flat.slice(0, 0, -1) & flat.slice(0, 1)), 0.49, 0.003);
  EXPECT_NEAR(fraction(flat.slice(0, 0, -1000) & flat.slice(0, 1000)), 0.49, 0.003) << "rows are independent";

  // Element i's bits: half of splitmix64's mix of (seed + (i / 2) x golden step), the seed one
  // 64-bit draw from the generator; kept when below (1 - p) x 2^32. Checked element by element
  // against the formula written out plainly here, over an odd count.
  {
    at::Generator drawn = make_generator(c10::kCPU, 3);
    const uint64_t seed = at::check_generator<at::CPUGeneratorImpl>(drawn)->random64();
    const auto threshold = static_cast<uint64_t>(std::llround(0.7 * 4294967296.0));
    const at::Tensor odd_like = torch::empty({2 * 32768 + 1001});  // past one parallel task's range
    at::Generator generator_again = make_generator(c10::kCPU, 3);
    const at::Tensor mask = dropout_keep_mask(odd_like, 0.3, generator_again);
    const float* m = mask.data_ptr<float>();
    int64_t mismatches = 0;
    for (int64_t i = 0; i < odd_like.numel(); ++i) {
      uint64_t z = seed + static_cast<uint64_t>(i / 2) * 0x9E3779B97F4A7C15ULL;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      z ^= z >> 31;
      const uint64_t bits = i % 2 == 0 ? (z & 0xFFFFFFFFULL) : (z >> 32);
      mismatches += (bits < threshold) != (m[i] != 0.0f);
    }
    EXPECT_EQ(mismatches, 0);
  }

  // Its dtype and shape follow `like` (a transposed view included): bf16 keeps where fp32 keeps.
  generator = make_generator(c10::kCPU, 3);
  const at::Tensor bf16 = dropout_keep_mask(like.to(torch::kBFloat16).t(), 0.3, generator);
  EXPECT_EQ(bf16.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(bf16.is_contiguous());
  EXPECT_TRUE(torch::equal(bf16 != 0, keep));
  EXPECT_THROW(dropout_keep_mask(like, 1.0, generator), c10::Error);
}

TEST(Dropout, FusedDropoutIsInputTimesKeepMaskBitForBitWithItsGradient) {
  // The training path drops in one pass and keeps the mask as bytes; it must give exactly
  // x * dropout_keep_mask(x) from the same generator state, forward and backward, in fp32 and bf16,
  // for odd sizes, transposed inputs, NaN and infinity, and any thread count.
  torch::nn::Dropout module(0.3);
  module->train();
  const int threads = at::get_num_threads();
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const bool transposed : {false, true}) {
      for (const int n_threads : {1, 2}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + (transposed ? " transposed" : "") + " threads " +
                     std::to_string(n_threads));
        at::set_num_threads(n_threads);
        torch::manual_seed(4);
        at::Tensor base = torch::randn({257, 301}).to(dtype);  // odd: the last draw's high word unused
        base[3][5] = std::numeric_limits<float>::quiet_NaN();
        base[7][2] = std::numeric_limits<float>::infinity();
        const at::Tensor x = (transposed ? base.t() : base).detach().requires_grad_();
        const at::Tensor grad_out = torch::randn(x.sizes()).to(dtype);
        at::Tensor fused;
        {
          DropoutGeneratorScope scope(make_generator(c10::kCPU, 9));
          fused = dropout(x, module);
        }
        const at::Tensor dx_fused = torch::autograd::grad({fused}, {x}, {grad_out})[0];
        at::Generator generator = make_generator(c10::kCPU, 9);
        const at::Tensor reference = x * dropout_keep_mask(x, 0.3, generator);
        const at::Tensor dx_reference = torch::autograd::grad({reference}, {x}, {grad_out})[0];
        EXPECT_EQ(fused.scalar_type(), dtype);
        EXPECT_EQ(dx_fused.scalar_type(), dtype);
        // Bit for bit, NaN where the reference has NaN (a dropped NaN or infinity times 0 included).
        EXPECT_TRUE(torch::equal(fused.isnan(), reference.isnan()));
        EXPECT_TRUE(torch::equal(fused.nan_to_num(0), reference.nan_to_num(0)));
        EXPECT_TRUE(torch::equal(dx_fused, dx_reference));
      }
    }
  }
  at::set_num_threads(threads);
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
  // A mask with batch dimensions: [batch, 1, queries, keys], each row of the batch its own.
  const at::Tensor batch_mask = torch::stack({mask, mask.logical_not().logical_or(torch::eye(2, 6, torch::kBool))})
                                    .unsqueeze(1);
  EXPECT_TRUE(torch::allclose(attention_with_dropout(q2, k, v, batch_mask, false, 0.0, scale, generator),
                              at::scaled_dot_product_attention(q2, k, v, batch_mask, 0.0, false, scale), 1e-5, 1e-6));
  const at::Tensor q1 = q.slice(2, 5, 6);
  EXPECT_TRUE(torch::allclose(attention_with_dropout(q1, k, v, std::nullopt, false, 0.0, scale, generator),
                              at::scaled_dot_product_attention(q1, k, v, std::nullopt, 0.0, false, scale), 1e-5, 1e-6));
  EXPECT_THROW(attention_with_dropout(q2, k, v, std::nullopt, true, 0.0, scale, generator), c10::Error);
  EXPECT_TRUE(torch::equal(attention_with_dropout(q, k, v, std::nullopt, true, 1.0, scale, generator),
                           torch::zeros_like(q)))
      << "p = 1 drops every probability";
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
