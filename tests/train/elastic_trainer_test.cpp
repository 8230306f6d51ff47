// Elastic training's recovery over 3 processes (worker scenario "elastic_train", the launcher
// serving the store and elastic): 6 steps of a tiny GPT-2, each replica's batches from a seed of
// its own. Killed at the start of its third step (k = 2), replica 1's rows go to the other two, which end with
// the undisturbed run's weights by the AdamW rule, bit-identical to each other.
#include "harness/train/elastic_trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../support/multi_process.h"
#include "harness/data_parallel/launcher.h"
#include "test_support.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;
constexpr int kSteps = 6;

data::Batch replica_batch(const model::GPT2Config& config, int replica, int64_t step) {
  torch::manual_seed(1000 * replica + step + 1);
  data::Batch b;
  b.input_ids = torch::randint(config.vocab_size, {5, 12}, torch::kLong);
  b.labels = torch::randint(config.vocab_size, {5, 12}, torch::kLong);
  b.label_token_weights = (torch::rand({5, 12}) > 0.3).to(torch::kFloat32);
  return b;
}

std::string weights_file(const std::string& prefix, int rank) { return prefix + ".rank" + std::to_string(rank) + ".pt"; }

void elastic_train_scenario(const dp::WorkerEnv& env) {
  const int kill_at = std::atoi(std::getenv("HARNESS_TEST_KILL_AT"));
  const std::string out = std::getenv("HARNESS_TEST_OUT");
  dp::DistOptions options = dp::dist_options_for(env, dp::Backend::kGloo);
  // A survivor blocked in a collective with another survivor (which left it for the dead one's
  // error) learns of the loss when the collective times out: the join window is longer.
  options.timeout = std::chrono::seconds(3);
  const model::GPT2Config config = testing::tiny_config(2, 0.0);
  StepComposition composition;
  composition.optimizer = OptimizerSettings(1e-3);
  ElasticSettings settings;
  settings.join_window = std::chrono::seconds(10);
  ElasticTrainer trainer(testing::make_model(config), composition, options, dp::init_process_group(options),
                         [&](int replica, int64_t step) { return std::vector<data::Batch>{replica_batch(config, replica, step)}; },
                         settings);
  for (int64_t k = 0; k < kSteps; ++k) {
    if (env.rank == 1 && k == kill_at) {
      std::printf("scenario elastic_train passed on rank 1\n");  // its part: to be lost
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    trainer.step(k);
  }
  std::vector<at::Tensor> weights;
  for (const auto& item : trainer.current().model()->named_parameters()) weights.push_back(item.value().detach().clone());
  torch::save(weights, weights_file(out, env.rank));
  EXPECT_EQ(trainer.membership().replica_count(), kill_at >= 0 ? 2 : 3);
  ASSERT_EQ(trainer.events().size(), kill_at >= 0 ? 1u : 0u);
  if (kill_at >= 0) {
    const MembershipEvent& change = trainer.events().front();
    EXPECT_EQ(change.generation, 1);
    EXPECT_EQ(change.step, kill_at + 1);  // the third step (1-based, as metrics.jsonl counts)
    EXPECT_TRUE(change.joined.empty());
    EXPECT_EQ(change.replicas, 2);
    EXPECT_EQ(change.lost, std::vector<int>{1});
  }
}

std::map<std::string, at::Tensor> load_weights(const std::string& path) {
  std::vector<at::Tensor> tensors;
  torch::load(tensors, path);
  std::map<std::string, at::Tensor> out;
  size_t i = 0;
  for (const auto& item : testing::make_model(testing::tiny_config(2, 0.0))->named_parameters()) {
    out[item.key()] = tensors.at(i++);
  }
  return out;
}

test_workers::CapturedLaunch elastic_run(const std::string& out, int kill_at) {
  return test_workers::launch_test_workers(
      "train_tests", "ElasticWorker.Run", "elastic_train", 3,
      {{"HARNESS_TEST_KILL_AT", std::to_string(kill_at)}, {"HARNESS_TEST_OUT", out}}, std::chrono::seconds(5),
      [](dp::LaunchOptions& o) {
        o.serve_store = true;
        o.elastic = true;
      });
}

TEST(ElasticTrainer, AKilledReplicasRowsGoToTheOthersWhichEndWithTheUndisturbedWeights) {
  const std::string made = test_workers::make_temp_dir("elastic-trainer");
  ASSERT_FALSE(made.empty());
  const std::filesystem::path dir = made;
  const auto plain = elastic_run((dir / "plain").string(), -1);
  ASSERT_EQ(plain.result.exit_code, 0) << plain.result.failure << "\n" << plain.joined();
  const auto elastic = elastic_run((dir / "elastic").string(), 2);
  ASSERT_EQ(elastic.result.exit_code, 0) << elastic.result.failure << "\n" << elastic.joined();
  EXPECT_EQ(elastic.result.lost, std::vector<int>{1});
  EXPECT_NE(elastic.joined().find("elastic: generation 1 at step 3: lost process 1; 2 of 3 replicas go on"),
            std::string::npos)
      << elastic.joined();
  const auto expected = load_weights(weights_file((dir / "plain").string(), 0));
  const auto first = load_weights(weights_file((dir / "elastic").string(), 0));
  const auto third = load_weights(weights_file((dir / "elastic").string(), 2));
  for (const auto& [name, w] : first) EXPECT_TRUE(torch::equal(third.at(name), w)) << name;
  test_support::expect_weights_agree_after_adamw(first, expected, testing::tiny_config(2, 0.0).n_embd, {1e-3, kSteps},
                                                 1e-2, "replica 1 lost at step 2");
  // Every replica of the undisturbed run ends alike, and training moved the weights.
  EXPECT_TRUE(torch::equal(load_weights(weights_file((dir / "plain").string(), 1)).at("transformer.wte.weight"),
                           expected.at("transformer.wte.weight")));
  const auto initial = testing::make_model(testing::tiny_config(2, 0.0))->named_parameters();
  EXPECT_FALSE(torch::equal(initial["transformer.wte.weight"], expected.at("transformer.wte.weight")));
  test_workers::remove_tree(made);
}

TEST(ElasticWorker, Run) { test_workers::play_worker_scenario({{"elastic_train", elastic_train_scenario}}); }

}  // namespace
}  // namespace harness::train
