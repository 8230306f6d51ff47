// GPT-2 given a context-parallel group against the same model without one: each rank runs its
// zigzag shard of the sequences and must get the whole sequences' loss, its shard of the logits,
// and gradients that sum over the group to the whole model's; the cached (generation) path stays
// plain attention.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "harness/model/context_parallel.h"
#include "harness/model/gpt2.h"

namespace harness::context_parallel::testing {

inline bool close(const at::Tensor& a, const at::Tensor& b, double rtol = 1e-4, double atol = 1e-5) {
  return a.sizes() == b.sizes() && torch::allclose(a, b, rtol, atol);
}

// `group` is shared with the model (it must outlive the backward); `sequence_chunk` positions per
// zigzag chunk, so sequences of 2 * C * sequence_chunk positions.
inline void expect_gpt2_matches_plain(const std::shared_ptr<model::ContextParallelGroup>& group,
                                      int64_t sequence_chunk = 3) {
  const int C = group->size(), c = group->rank();
  model::GPT2Config config = model::GPT2Config::preset("gpt2-tiny");
  config.vocab_size = 53;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  torch::manual_seed(7);
  model::GPT2LMHeadModel plain(config);
  torch::manual_seed(7);
  model::GPT2LMHeadModel split(config);
  split->set_context_parallel(group);
  ASSERT_EQ(split->context_parallel(), group.get());

  const int64_t B = 2, S = 2 * C * sequence_chunk;
  torch::manual_seed(11);  // every rank draws the same whole batch
  const at::Tensor ids = torch::randint(0, config.vocab_size, {B, S}, torch::kLong);
  const at::Tensor labels = torch::randint(0, config.vocab_size, {B, S}, torch::kLong);
  at::Tensor weights = (torch::rand({B, S}) > 0.3).to(torch::kFloat);
  weights.index_put_({0, 0}, 1.0f);
  auto shard = [&](const at::Tensor& x) { return model::zigzag_shard(x, 1, C, c); };

  const at::Tensor reference_loss = plain->loss(ids, labels, weights);
  reference_loss.backward();
  const at::Tensor loss = split->loss(shard(ids), shard(labels), shard(weights));
  EXPECT_TRUE(close(loss, reference_loss)) << loss.item<double>() << " vs " << reference_loss.item<double>();
  loss.backward();
  auto reference_grads = plain->named_parameters();
  for (const auto& item : split->named_parameters()) {
    at::Tensor summed = item.value().grad().clone();
    group->all_reduce_sum(summed);
    EXPECT_TRUE(close(summed, reference_grads[item.key()].grad(), 1e-4, 1e-6)) << item.key();
  }

  torch::NoGradGuard no_grad;
  // The whole divisor given: no collective, the same loss.
  const at::Tensor given = split->loss(shard(ids), shard(labels), shard(weights), weights.sum());
  EXPECT_TRUE(close(given, reference_loss));
  EXPECT_TRUE(close(split->forward(shard(ids)), shard(plain->forward(ids)))) << "logits of the shard";
  model::KVCache plain_cache, split_cache;
  EXPECT_TRUE(close(split->forward_cached(ids, split_cache), plain->forward_cached(ids, plain_cache)))
      << "the cached path is plain attention on whole sequences";
}

}  // namespace harness::context_parallel::testing
