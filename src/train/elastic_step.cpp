// The elastic TrainStep and its mirror of the replicas' data (see elastic_step.h).
#include "harness/train/elastic_step.h"

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

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

// Test hook HARNESS_TEST_KILL_AT_STEP="<launch rank>:<step>[:stop][,...]": that process kills
// itself (SIGKILL, as kill -9 would) as it starts that step (counted from 1), or with ":stop"
// stops itself (SIGSTOP, as a hung machine would look).
void kill_here_if_asked(int launch_rank, int64_t step) {
  const char* hook = std::getenv("HARNESS_TEST_KILL_AT_STEP");
  if (hook == nullptr) return;
  std::stringstream items(hook);
  for (std::string item; std::getline(items, item, ',');) {
    std::stringstream fields(item);
    std::string rank, at, how;
    std::getline(fields, rank, ':');
    std::getline(fields, at, ':');
    std::getline(fields, how, ':');
    if (rank.empty() || at.empty() || std::atoi(rank.c_str()) != launch_rank || std::atoll(at.c_str()) != step) continue;
    const bool stop = how == "stop";
    std::cerr << "[process " << launch_rank << "] test hook: " << (stop ? "stopped" : "killed") << " at step " << step
              << std::endl;
    std::raise(stop ? SIGSTOP : SIGKILL);
  }
}

// Test hook HARNESS_TEST_EXAMPLE_DIGESTS=<folder>: each process appends "<step> <count> <digest>"
// for every step it trains to <folder>/process<launch rank>.txt.
void record_examples_if_asked(int launch_rank, int64_t step, const ExampleDigest& examples) {
  const char* folder = std::getenv("HARNESS_TEST_EXAMPLE_DIGESTS");
  if (folder == nullptr || *folder == '\0') return;
  std::ofstream out(std::string(folder) + "/process" + std::to_string(launch_rank) + ".txt", std::ios::app);
  out << step << ' ' << examples.count << ' ' << examples.digest << '\n';
}

}  // namespace

ElasticTrainStep::ElasticTrainStep(model::GPT2LMHeadModel model, StepComposition composition, dp::DistOptions options,
                                   dp::DistContext world, ReplicaBatchMirror& mirror, ElasticSettings settings,
                                   TrainStepSettings step_settings)
    : mirror_(mirror),
      trainer_(
          std::move(model), std::move(composition), std::move(options), std::move(world),
          [this](int replica, int64_t) {
            if (replica == trainer_.replica()) return *own_;
            std::vector<data::Batch> out;
            for (const data::Batch& b : mirror_.batches(replica, static_cast<int64_t>(own_->size()))) {
              out.push_back(b.to(input_device()));
            }
            return out;
          },
          settings, std::move(step_settings)) {}

double ElasticTrainStep::step(const std::vector<data::Batch>& batches) {
  kill_here_if_asked(trainer_.launch_rank(), global_step_ + 1);
  own_ = &batches;
  const double loss = trainer_.step(global_step_);
  own_ = nullptr;
  mirror_.advance(static_cast<int64_t>(batches.size()));
  ++global_step_;
  record_examples_if_asked(trainer_.launch_rank(), global_step_, trainer_.last_examples());
  return loss;
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
