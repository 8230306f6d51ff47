// Steps that survive a lost replica (see elastic_trainer.h).
#include "harness/train/elastic_trainer.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <iomanip>
#include <iostream>
#include <stdexcept>
#include <string>

#include "harness/train/elastic_batches.h"

namespace harness::train {

namespace dp = harness::data_parallel;

bool is_communication_failure(const std::exception& error) {
  if (dynamic_cast<const c10::DistError*>(&error) != nullptr) return true;
  const std::string what = error.what();
  for (const char* sign : {"gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out",
                           "timed out", "NCCL", "Broken pipe"}) {
    if (what.find(sign) != std::string::npos) return true;
  }
  return false;
}

ExampleDigest example_digest(const std::vector<data::Batch>& batches) {
  ExampleDigest out;
  for (const data::Batch& batch : batches) {
    for (const data::TranslationExample& example : batch.examples) {
      uint64_t hash = 1469598103934665603ull;  // FNV-1a, 64 bits
      auto add = [&hash](const std::string& text) {
        for (const unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
      };
      add(example.de);
      hash = (hash ^ 0u) * 1099511628211ull;
      add(example.en);
      out.digest += hash;
      ++out.count;
    }
  }
  return out;
}

ElasticTrainer::ElasticTrainer(model::GPT2LMHeadModel model, StepComposition composition, dp::DistOptions options,
                               dp::DistContext world, BatchSource batches, ElasticSettings settings,
                               TrainStepSettings step_settings)
    : model_(std::move(model)),
      composition_(std::move(composition)),
      options_(std::move(options)),
      first_world_(world),
      world_(std::move(world)),
      batches_(std::move(batches)),
      settings_(settings),
      step_settings_(std::move(step_settings)),
      launch_rank_(first_world_.rank) {
  if (composition_.stages || composition_.data_parallel.zero_stage != 0 || model_->tensor_parallel() != nullptr) {
    throw std::invalid_argument(
        "elastic training recovers replicas of the whole model without ZeRO (data parallelism alone) so far");
  }
  membership_ = parallel::initial_membership(first_world_.world_size, {});
  if (settings_.min_replicas < 1 || settings_.min_replicas > membership_.original_replicas) {
    throw std::invalid_argument("--min_replicas " + std::to_string(settings_.min_replicas) + ": expected 1 to " +
                                std::to_string(membership_.original_replicas) + " (the data-parallel size)");
  }
  replica_ = membership_.layout().coordinates_of(launch_rank_).data;
  generation_.number = 0;
  for (int r = 0; r < first_world_.world_size; ++r) generation_.members.push_back(r);
  compose();
}

ElasticTrainer::~ElasticTrainer() = default;

void ElasticTrainer::compose() {
  const parallel::Layout layout = membership_.layout();
  groups_ = parallel::make_process_groups(world_, options_, layout);
  StepParts parts = compose_step(model_, layout, groups_, composition_);
  sync_ = std::move(parts.sync);
  step_ = std::make_unique<GPT2TrainStep>(model_, std::move(parts.forward_backward), std::move(parts.optimizer),
                                          sync_.get(), step_settings_);
  step_->set_training(true);
}

void ElasticTrainer::check_members_alive() const {
  for (const int member : generation_.members) {
    if (member != launch_rank_ && first_world_.store->check({dp::lost_process_key(member)})) {
      throw LostProcessError("elastic: process " + std::to_string(member) + " of generation " +
                               std::to_string(generation_.number) + " was lost outside a training step");
    }
  }
}

double ElasticTrainer::step(int64_t k) {
  for (;;) {
    // This member's rows: its own batches, and its share of every dropped replica's.
    std::vector<std::vector<data::Batch>> replica_batches(membership_.original_replicas);
    std::vector<int64_t> rows(membership_.original_replicas, 0);
    for (int r = 0; r < membership_.original_replicas; ++r) {
      if (r != replica_ && membership_.member_index(r) >= 0) continue;
      replica_batches[r] = batches_(r, k);
      for (const data::Batch& b : replica_batches[r]) rows[r] += b.input_ids.size(0);
    }
    const auto plan = parallel::rows_per_member(membership_, rows);
    const ElasticStepBatches mine = elastic_step_batches(membership_, plan.at(membership_.member_index(replica_)),
                                                         replica_batches);
    try {
      const double loss = step_->step(mine.batches, mine.loss_divisors);
      last_examples_ = example_digest(mine.batches);
      return loss;
    } catch (const std::exception& e) {
      if (!is_communication_failure(e)) throw;
      std::cerr << "[process " << launch_rank_ << "] elastic: step " << k + 1 << " failed in a collective ("
                << std::string(e.what()).substr(0, std::string(e.what()).find('\n')) << "); agreeing who is left"
                << std::endl;
    }
    recover(k);
  }
}

void ElasticTrainer::recover(int64_t k) {
  const auto start = std::chrono::steady_clock::now();
  // The weights have not moved (the optimizer steps after the all-reduce); AdamW's state and rate
  // go over to the next generation's step as they are. The failed generation's step and groups go
  // first: tearing down their connections takes a while, which the join window absorbs, not the
  // next group's rendezvous.
  const OptimizerState state = step_->optimizer_state();
  const double learning_rate = step_->learning_rate();
  model::NamedTensors weights;
  for (const auto& item : model_->named_parameters()) weights.emplace_back(item.key(), item.value().detach().clone());
  step_.reset();  // its synchronizer's hooks leave the parameters first
  sync_.reset();
  groups_ = parallel::ProcessGroups{};
  if (generation_.number > 0) world_.group.reset();  // the first generation's stays with first_world_
  const dp::Generation next =
      dp::agree_next_generation(*first_world_.store, generation_, launch_rank_, settings_.join_window);
  std::vector<int> lost_ranks, lost_processes;
  for (size_t i = 0; i < generation_.members.size(); ++i) {
    if (next.rank_of(generation_.members[i]) < 0) {
      lost_ranks.push_back(static_cast<int>(i));
      lost_processes.push_back(generation_.members[i]);
    }
  }
  const parallel::MembershipChange change = parallel::drop_lost_ranks(membership_, lost_ranks);
  std::string lost_text;
  for (const int p : lost_processes) lost_text += (lost_text.empty() ? "" : ", ") + std::to_string(p);
  if (change.next.member_index(replica_) < 0) {
    throw dp::DeadGenerationError("elastic: process " + std::to_string(launch_rank_) + "'s replica " +
                                  std::to_string(replica_) + " lost process " + lost_text +
                                  " and cannot train; it leaves generation " + std::to_string(next.number));
  }
  if (change.next.replica_count() < settings_.min_replicas) {
    throw std::runtime_error("elastic: lost process " + lost_text + " at step " + std::to_string(k + 1) + "; " +
                             std::to_string(change.next.replica_count()) + " replica(s) left, below --min_replicas " +
                             std::to_string(settings_.min_replicas));
  }
  // The members in the next generation's rank order.
  std::vector<int> order(change.next.layout().world_size(), -1);
  for (size_t i = 0; i < generation_.members.size(); ++i) {
    const int rank = change.rank_in_next.at(i);
    if (rank >= 0) order.at(rank) = generation_.members[i];
  }
  world_ = dp::connect_generation(first_world_, next, order, launch_rank_, options_);
  generation_ = next;
  membership_ = change.next;
  compose();
  step_->load_state(weights, state);
  step_->set_learning_rate(learning_rate);
  events_.push_back({next.number, k + 1, membership_.replica_count(), lost_processes, {}});
  if (world_.rank != 0) return;  // one line for the change, from the generation's rank 0
  std::cerr << "elastic: generation " << next.number << " at step " << k + 1 << ": lost process" <<
            (lost_processes.size() > 1 ? "es " : " ") << lost_text << "; "
            << membership_.replica_count() << " of " << membership_.original_replicas << " replicas go on ("
            << std::fixed << std::setprecision(3)
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
            << " s to agree and reconnect)" << std::defaultfloat << std::endl;
}

}  // namespace harness::train
