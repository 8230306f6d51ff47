// The elastic TrainStep and its mirror of the replicas' data (see elastic_step.h).
#include "harness/train/elastic/elastic_step.h"

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness/data_parallel/elastic_rendezvous.h"

namespace harness::train {

namespace dp = harness::data_parallel;

ReplicaBatchMirror::ReplicaBatchMirror(MakeLoader make) : make_(std::move(make)) {}

ReplicaBatchMirror::~ReplicaBatchMirror() = default;

void ReplicaBatchMirror::start_epoch(int64_t epoch, int64_t first_batch) {
  epoch_ = epoch;
  position_ = first_batch;
  for (auto& [r, replica] : replicas_) replica.read = false;
}

const std::vector<data::Batch>& ReplicaBatchMirror::batches(int replica_index, int64_t count) {
  Replica& replica = replicas_[replica_index];
  if (replica.read) return replica.step;
  if (!replica.loader) replica.loader = make_(replica_index);
  if (replica.epoch != epoch_ || replica.position != position_) {
    // Where the driver stands now (the first time, or after a gap in which others held it).
    replica.loader->set_epoch(epoch_).start_epoch(epoch_, position_);
    replica.epoch = epoch_;
    replica.position = position_;
  }
  replica.step.clear();
  while (static_cast<int64_t>(replica.step.size()) < count) {
    std::optional<data::Batch> batch = replica.loader->loader().next();
    if (!batch) break;
    replica.step.push_back(std::move(*batch));
  }
  replica.position += static_cast<int64_t>(replica.step.size());
  replica.read = true;
  return replica.step;
}

void ReplicaBatchMirror::advance(int64_t count) {
  position_ += count;
  for (auto& [r, replica] : replicas_) replica.read = false;
}

namespace {

// Test hook HARNESS_TEST_EXAMPLE_DIGESTS=<folder>: each process appends "<step> <count> <digest>"
// for every step it trains to <folder>/process<launch rank>.txt.
void record_examples_if_asked(int launch_rank, int64_t step, const ExampleDigest& examples) {
  const char* folder = std::getenv("HARNESS_TEST_EXAMPLE_DIGESTS");
  if (folder == nullptr || *folder == '\0') return;
  std::ofstream out(std::string(folder) + "/process" + std::to_string(launch_rank) + ".txt", std::ios::app);
  out << step << ' ' << examples.count << ' ' << examples.digest << '\n';
}

// Test and benchmark hook HARNESS_TEST_JOIN_AT_STEP=<step>: a replacement joins at that step (counted
// from 1). The members reach its start, say so in the store and wait for the replacement to ask;
// the replacement asks only then (it would otherwise join at whichever boundary follows its start).
constexpr const char* kAtTheJoinStep = "test/at the join step";

// The steps of HARNESS_TEST_JOIN_AT_STEP (a comma-separated list: a replacement joins at each).
std::vector<int64_t> join_steps_asked() {
  const char* hook = std::getenv("HARNESS_TEST_JOIN_AT_STEP");
  std::vector<int64_t> steps;
  for (const char* at = hook; at != nullptr && *at != '\0';) {
    char* end = nullptr;
    steps.push_back(std::strtoll(at, &end, 10));
    at = *end == ',' ? end + 1 : end + std::strlen(end);
  }
  return steps;
}

dp::DistContext when_the_others_admit(dp::DistContext world, const ElasticSettings& settings) {
  if (settings.join_id >= 0 && !join_steps_asked().empty()) {
    world.store->wait({kAtTheJoinStep}, std::chrono::minutes(5));
  }
  return world;
}

void wait_for_the_replacement_if_asked(const ElasticTrainer& trainer, int64_t step) {
  const std::vector<int64_t> steps = join_steps_asked();
  if (trainer.is_replacement() || std::find(steps.begin(), steps.end(), step) == steps.end()) return;
  c10d::Store& store = *trainer.first_world().store;
  store.set(kAtTheJoinStep, std::vector<uint8_t>{1});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  // Every rank of the lost replica's replacements (they join together), their requests written.
  const parallel::LayoutSizes& sizes = trainer.membership().sizes;
  const auto waiting = [&store] {
    int n = 0;
    for (const dp::JoinRequest& request : dp::joins_after(store, 0)) {
      n += store.check({dp::admitted_key(request.launch_id)}) ? 0 : 1;
    }
    return n;
  };
  while (waiting() < sizes.context * sizes.tensor * sizes.pipeline) {
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("test hook: no replacement asked to join");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

ElasticTrainStep::ElasticTrainStep(model::GPT2LMHeadModel model, StepComposition composition, dp::DistOptions options,
                                   dp::DistContext world, ReplicaBatchMirror& mirror, ElasticSettings settings,
                                   TrainStepSettings step_settings)
    : mirror_(mirror),
      trainer_(
          std::move(model), std::move(composition), std::move(options), when_the_others_admit(std::move(world), settings),
          [this](int replica, int64_t) {
            if (replica == trainer_.replica()) return *own_;
            std::vector<data::Batch> out;
            for (const data::Batch& b : mirror_.batches(replica, static_cast<int64_t>(own_->size()))) {
              out.push_back(b.to(input_device()));
            }
            return out;
          },
          settings, std::move(step_settings), [this] { return mirror_.position(); }) {}

double ElasticTrainStep::step(const std::vector<data::Batch>& batches) {
  kill_here_if_asked(trainer_.launch_rank(), global_step_ + 1, /*at_the_vote=*/false);
  wait_for_the_replacement_if_asked(trainer_, global_step_ + 1);
  own_ = &batches;
  const double loss = trainer_.step(global_step_);
  own_ = nullptr;
  mirror_.advance(static_cast<int64_t>(batches.size()));
  ++global_step_;
  record_examples_if_asked(trainer_.launch_rank(), global_step_, trainer_.last_examples());
  return loss;
}

std::optional<TrainingOptions::JoinedAt> ElasticTrainStep::joined_at() const {
  if (!trainer_.is_replacement()) return std::nullopt;
  const ElasticTrainer::DataPosition& data = trainer_.joined_at_position();
  return TrainingOptions::JoinedAt{data.epoch, data.batch, trainer_.joined_at_step()};
}

c10::Device ElasticTrainStep::input_device() const { return trainer_.current().input_device(); }

double ElasticTrainStep::learning_rate() const { return trainer_.current().learning_rate(); }

double ElasticTrainStep::last_grad_norm() const { return trainer_.current().last_grad_norm(); }

void ElasticTrainStep::set_global_step(int64_t global_step) {
  global_step_ = global_step;
  trainer_.current().set_global_step(global_step);
}

std::vector<MembershipRecord> ElasticTrainStep::take_membership_changes() {
  const std::vector<MembershipEvent>& events = trainer_.events();
  std::vector<MembershipRecord> out(events.begin() + static_cast<std::ptrdiff_t>(reported_events_), events.end());
  reported_events_ = events.size();
  return out;
}

}  // namespace harness::train
