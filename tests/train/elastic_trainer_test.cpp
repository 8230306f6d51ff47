// Elastic training's recovery over 3 processes (worker scenario "elastic_train", the launcher
// serving the store and elastic): 6 steps of a tiny GPT-2, each replica's batches from a seed of
// its own. Killed at the start of its third step (k = 2), replica 1's rows go to the other two, which end with
// the undisturbed run's weights by the AdamW rule, bit-identical to each other.
#include "harness/train/elastic/elastic_trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>
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
  const char* join_at_text = std::getenv("HARNESS_TEST_JOIN_AT");
  const int join_at = join_at_text != nullptr ? std::atoi(join_at_text) : -1;
  const char* join_id = std::getenv(dp::kElasticJoinIdVariable);  // set in the replacement
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
  settings.accept_joiners = join_at >= 0;
  if (join_id != nullptr) settings.join_id = std::atoi(join_id);
  settings.admission_timeout = std::chrono::seconds(60);
  const dp::DistContext world = join_id != nullptr ? dp::connect_rendezvous_store(options) : dp::init_process_group(options);
  if (join_id != nullptr) {
    // The replacement asks once the survivors are at the join step, so that it joins there (it
    // would otherwise join at whichever boundary follows its start).
    world.store->wait({"test/at the join step"}, std::chrono::seconds(60));
  }
  ElasticTrainer trainer(testing::make_model(config), composition, options, world,
                         [&](int replica, int64_t step) { return std::vector<data::Batch>{replica_batch(config, replica, step)}; },
                         settings);
  for (int64_t k = trainer.joined_at_step(); k < kSteps; ++k) {
    if (join_id == nullptr && env.rank == 1 && k == kill_at) {
      std::printf("scenario elastic_train passed on rank 1\n");  // its part: to be lost
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    if (join_id == nullptr && k == join_at) {
      // The survivors wait for the replacement to ask (it starts in a second or two), so that it
      // joins at this step.
      world.store->set("test/at the join step", std::vector<uint8_t>{1});
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (dp::joins_after(*world.store, 0).empty() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    trainer.step(k);
  }
  std::vector<at::Tensor> weights;
  for (const auto& item : trainer.current().model()->named_parameters()) weights.push_back(item.value().detach().clone());
  torch::save(weights, weights_file(out, trainer.launch_rank()));
  const bool joined = join_at >= 0;
  EXPECT_EQ(trainer.membership().replica_count(), kill_at >= 0 && !joined ? 2 : 3);
  std::vector<MembershipEvent> expected;
  if (kill_at >= 0 && join_id == nullptr) expected.push_back({1, kill_at + 1, 2, {1}, {}});
  if (joined) expected.push_back({2, join_at + 1, 3, {}, {3}});
  ASSERT_EQ(trainer.events().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const MembershipEvent& change = trainer.events()[i];
    EXPECT_EQ(change.generation, expected[i].generation);
    EXPECT_EQ(change.step, expected[i].step);  // counted from 1, as metrics.jsonl counts
    EXPECT_EQ(change.replicas, expected[i].replicas);
    EXPECT_EQ(change.lost, expected[i].lost);
    EXPECT_EQ(change.joined, expected[i].joined);
  }
  if (join_id != nullptr) {
    EXPECT_EQ(trainer.joined_at_step(), join_at);
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

test_workers::CapturedLaunch elastic_run(const std::string& out, int kill_at, int join_at = -1) {
  return test_workers::launch_test_workers(
      "train_tests", "ElasticWorker.Run", "elastic_train", 3,
      {{"HARNESS_TEST_KILL_AT", std::to_string(kill_at)},
       {"HARNESS_TEST_JOIN_AT", std::to_string(join_at)},
       {"HARNESS_TEST_OUT", out}},
      std::chrono::seconds(5), [join_at](dp::LaunchOptions& o) {
        o.serve_store = true;
        o.elastic = true;
        o.max_replacements = join_at >= 0 ? 1 : 0;
      });
}

// One undisturbed run, which every test compares against.
class ElasticTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = test_workers::make_temp_dir("elastic-trainer");
    ASSERT_FALSE(dir_.empty());
    const auto plain = elastic_run(path("plain"), -1);
    ASSERT_EQ(plain.result.exit_code, 0) << plain.result.failure << "\n" << plain.joined();
    expected_ = load_weights(weights_file(path("plain"), 0));
    // Every replica of the undisturbed run ends alike, and training moved the weights.
    ASSERT_TRUE(torch::equal(load_weights(weights_file(path("plain"), 1)).at("transformer.wte.weight"),
                             expected_.at("transformer.wte.weight")));
    const auto initial = testing::make_model(testing::tiny_config(2, 0.0))->named_parameters();
    ASSERT_FALSE(torch::equal(initial["transformer.wte.weight"], expected_.at("transformer.wte.weight")));
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) test_workers::remove_tree(dir_);
  }
  static std::string path(const std::string& run) { return (std::filesystem::path(dir_) / run).string(); }
  // The run's process-0 weights, checked bit-identical to those of `others` and equal to the
  // undisturbed run's by the AdamW rule.
  static void expect_undisturbed_weights(const std::string& run, const std::vector<int>& others,
                                         const std::string& what) {
    const auto first = load_weights(weights_file(path(run), 0));
    for (const int p : others) {
      const auto other = load_weights(weights_file(path(run), p));
      for (const auto& [name, w] : first) EXPECT_TRUE(torch::equal(other.at(name), w)) << "process " << p << ": " << name;
    }
    test_support::expect_weights_agree_after_adamw(first, expected_, testing::tiny_config(2, 0.0).n_embd,
                                                   {1e-3, kSteps}, 1e-2, what);
  }

  static inline std::string dir_;
  static inline std::map<std::string, at::Tensor> expected_;
};

TEST_F(ElasticTraining, AKilledReplicasRowsGoToTheOthersWhichEndWithTheUndisturbedWeights) {
  const auto elastic = elastic_run(path("elastic"), 2);
  ASSERT_EQ(elastic.result.exit_code, 0) << elastic.result.failure << "\n" << elastic.joined();
  EXPECT_EQ(elastic.result.lost, std::vector<int>{1});
  EXPECT_NE(elastic.joined().find("elastic: generation 1 at step 3: lost process 1; 2 of 3 replicas go on"),
            std::string::npos)
      << elastic.joined();
  expect_undisturbed_weights("elastic", {2}, "replica 1 lost at step 2");
}

// Growing back: replica 1 killed at its third step (k = 2); the launcher starts a replacement
// (launch id 3), which joins at k = 4, receives the survivors' weights and AdamW state, and trains
// replica 1's rows again. All three end bit-identical, with the undisturbed weights by the AdamW
// rule.
TEST_F(ElasticTraining, AReplacementJoinsAtAStepBoundaryAndEndsLikeTheOthers) {
  const auto grown = elastic_run(path("grown"), 2, 4);
  ASSERT_EQ(grown.result.exit_code, 0) << grown.result.failure << "\n" << grown.joined();
  EXPECT_EQ(grown.result.lost, std::vector<int>{1});
  EXPECT_EQ(grown.result.replacements, (std::vector<dp::LaunchResult::Replacement>{{3, 1}}));
  EXPECT_NE(grown.joined().find("elastic: generation 2 at step 5: process 3 joined; 3 of 3 replicas go on"),
            std::string::npos)
      << grown.joined();
  expect_undisturbed_weights("grown", {2, 3}, "replica 1 lost at step 3, replaced at step 5");
}

// What a generation change carries: a step composed again over the same parameters, with this
// rank's AdamW state (local_state, no collective) loaded, takes the next steps bit for bit as the
// step that was let go would have; without the state it would not.
TEST(ElasticState, LocalAdamWStateCarriesIntoAStepComposedAgain) {
  const auto make = [] { return testing::make_model(testing::tiny_config(2, 0.0)); };
  const auto step_with_gradients = [](model::GPT2LMHeadModel& model, StepOptimizer& optimizer, int64_t k) {
    optimizer.zero_grad();
    torch::manual_seed(100 + k);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::randn_like(p);
    optimizer.step();
  };
  model::GPT2LMHeadModel kept = make(), recomposed = make(), fresh = make();
  auto kept_optimizer = replicated_adamw(kept, OptimizerSettings(1e-2));
  auto recomposed_optimizer = replicated_adamw(recomposed, OptimizerSettings(1e-2));
  auto fresh_optimizer = replicated_adamw(fresh, OptimizerSettings(1e-2));
  for (int64_t k = 0; k < 2; ++k) {
    step_with_gradients(kept, *kept_optimizer, k);
    step_with_gradients(recomposed, *recomposed_optimizer, k);
    step_with_gradients(fresh, *fresh_optimizer, k);
  }
  const OptimizerState local = recomposed_optimizer->local_state();
  EXPECT_EQ(local.size(), recomposed->parameters().size());
  EXPECT_EQ(local.at("transformer.wte.weight").step, 2);
  recomposed_optimizer = replicated_adamw(recomposed, OptimizerSettings(1e-2));
  recomposed_optimizer->load_local_state(local);
  fresh_optimizer = replicated_adamw(fresh, OptimizerSettings(1e-2));  // its state not carried
  for (int64_t k = 2; k < 4; ++k) {
    step_with_gradients(kept, *kept_optimizer, k);
    step_with_gradients(recomposed, *recomposed_optimizer, k);
    step_with_gradients(fresh, *fresh_optimizer, k);
  }
  auto expected = kept->named_parameters(), other = fresh->named_parameters();
  for (const auto& item : recomposed->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), expected[item.key()])) << item.key();
  }
  EXPECT_FALSE(torch::equal(other["transformer.wte.weight"], expected["transformer.wte.weight"]));
}

TEST(ElasticWorker, Run) { test_workers::play_worker_scenario({{"elastic_train", elastic_train_scenario}}); }

}  // namespace
}  // namespace harness::train
