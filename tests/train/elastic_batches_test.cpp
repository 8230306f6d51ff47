// An elastic generation's batches (train/elastic/elastic_batches.h): the members' averaged gradient,
// each training its own step and a share of a dropped replica's, is the undisturbed run's average
// over every replica; with every replica a member, the step is the plain one bit for bit.
#include "harness/train/elastic/elastic_batches.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "harness/train/step/train_step.h"
#include "test_support.h"

namespace harness::train {
namespace {

using Gradients = std::map<std::string, at::Tensor>;

data::Batch random_batch(const model::GPT2Config& config, int64_t rows, uint64_t seed) {
  torch::manual_seed(seed);
  data::Batch b;
  b.input_ids = torch::randint(config.vocab_size, {rows, 12}, torch::kLong);
  b.labels = torch::randint(config.vocab_size, {rows, 12}, torch::kLong);
  b.label_token_weights = (torch::rand({rows, 12}) > 0.4).to(torch::kFloat32);
  return b;
}

// The gradients of one step of a fresh model (the same weights every time) on `batches`.
Gradients gradients_after(const model::GPT2Config& config, const std::vector<data::Batch>& batches,
                          const std::vector<double>& divisors = {}) {
  GPT2TrainStep step(testing::make_model(config), OptimizerSettings(1e-3));
  Gradients out;
  step.after_backward = [&] {
    for (const auto& p : step.model()->named_parameters()) out[p.key()] = p.value().grad().clone();
  };
  step.set_training(true);
  step.step(batches, divisors);
  return out;
}

Gradients mean_of(const std::vector<Gradients>& all) {
  Gradients out;
  for (const auto& [name, g] : all.front()) {
    at::Tensor sum = torch::zeros_like(g, torch::kFloat64);
    for (const Gradients& one : all) sum += one.at(name).to(torch::kFloat64);
    out[name] = sum / static_cast<double>(all.size());
  }
  return out;
}

// Three replicas, each step two accumulation batches (4 + 3 rows; replica 2's 4 + 2).
std::vector<std::vector<data::Batch>> three_replicas(const model::GPT2Config& config) {
  return {{random_batch(config, 4, 1), random_batch(config, 3, 2)},
          {random_batch(config, 4, 3), random_batch(config, 3, 4)},
          {random_batch(config, 4, 5), random_batch(config, 2, 6)}};
}

TEST(ElasticBatches, TheSurvivorsAveragedGradientIsTheUndisturbedOne) {
  const model::GPT2Config config = testing::tiny_config(2, 0.0);
  const auto replicas = three_replicas(config);
  std::vector<Gradients> undisturbed;
  for (const auto& batches : replicas) undisturbed.push_back(gradients_after(config, batches));
  const Gradients expected = mean_of(undisturbed);

  for (const int lost : {0, 1, 2}) {
    const parallel::Membership m = parallel::drop_lost_ranks(parallel::initial_membership(3, {}), {lost}).next;
    const auto plan = parallel::rows_per_member(m, {7, 7, 6});
    std::vector<Gradients> members;
    for (size_t j = 0; j < plan.size(); ++j) {
      const ElasticStepBatches step = elastic_step_batches(m, plan[j], replicas);
      members.push_back(gradients_after(config, step.batches, step.loss_divisors));
    }
    const Gradients got = mean_of(members);
    for (const auto& [name, g] : expected) {
      EXPECT_LT(testing::relative(got.at(name), g), 1e-5) << "replica " << lost << " lost: " << name;
    }
  }
}

TEST(ElasticBatches, ASliceAcrossTwoBatchesIsCutIntoBothAndKeepsItsDivisor) {
  const model::GPT2Config config = testing::tiny_config(1, 0.0);
  const auto replicas = three_replicas(config);
  const parallel::Membership m = parallel::drop_lost_ranks(parallel::initial_membership(3, {}), {1}).next;
  // Member 2's share of replica 1's 7 rows is [4, 7): the second batch whole. Member 0's, [0, 4):
  // the first. A slice [2, 6) takes rows 2-3 of the first and 0-1 of the second.
  const ElasticStepBatches cut = elastic_step_batches(m, {{1, 2, 6}}, replicas);
  ASSERT_EQ(cut.batches.size(), 2u);
  EXPECT_TRUE(torch::equal(cut.batches[0].input_ids, replicas[1][0].input_ids.slice(0, 2, 4)));
  EXPECT_TRUE(torch::equal(cut.batches[1].input_ids, replicas[1][1].input_ids.slice(0, 0, 2)));
  const double weight = replicas[1][0].label_token_weights.sum().item<double>() +
                        replicas[1][1].label_token_weights.sum().item<double>();
  EXPECT_DOUBLE_EQ(cut.loss_divisors[0], weight * 1.5);
  EXPECT_DOUBLE_EQ(cut.loss_divisors[1], weight * 1.5);
  EXPECT_THROW(elastic_step_batches(m, {{1, 5, 8}}, replicas), std::invalid_argument);
  EXPECT_THROW(elastic_step_batches(m, {{1, 0, 1}}, {replicas[0], replicas[1]}), std::invalid_argument);
}

TEST(ElasticBatches, WithEveryReplicaAMemberTheStepIsThePlainOne) {
  const model::GPT2Config config = testing::tiny_config(2, 0.0);
  const auto replicas = three_replicas(config);
  const parallel::Membership all = parallel::initial_membership(3, {});
  const auto plan = parallel::rows_per_member(all, {7, 7, 6});
  for (int r = 0; r < 3; ++r) {
    const ElasticStepBatches step = elastic_step_batches(all, plan[r], replicas);
    const Gradients plain = gradients_after(config, replicas[r]);
    const Gradients elastic = gradients_after(config, step.batches, step.loss_divisors);
    for (const auto& [name, g] : plain) EXPECT_TRUE(torch::equal(elastic.at(name), g)) << "replica " << r << ": " << name;
  }
}

}  // namespace
}  // namespace harness::train
