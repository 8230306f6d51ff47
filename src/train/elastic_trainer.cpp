// Steps that survive a lost replica (see elastic_trainer.h).
#include "harness/train/elastic_trainer.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <iomanip>
#include <algorithm>
#include <utility>
#include <iostream>
#include <stdexcept>
#include <string>

#include "harness/tensor_parallel/group.h"
#include "harness/train/elastic_batches.h"

namespace harness::train {

namespace dp = harness::data_parallel;
namespace tp = harness::tensor_parallel;

bool is_communication_failure(const std::exception& error) {
  if (dynamic_cast<const c10::DistError*>(&error) != nullptr) return true;
  const std::string what = error.what();
  for (const char* sign : {"gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out",
                           "timed out", "NCCL", "Broken pipe"}) {
    if (what.find(sign) != std::string::npos) return true;
  }
  return false;
}

uint64_t fnv1a(const void* data, size_t size, uint64_t hash) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

ExampleDigest example_digest(const std::vector<data::Batch>& batches) {
  ExampleDigest out;
  for (const data::Batch& batch : batches) {
    for (const data::TranslationExample& example : batch.examples) {
      const char separator = '\0';
      out.digest += fnv1a(example.en.data(), example.en.size(),
                          fnv1a(&separator, 1, fnv1a(example.de.data(), example.de.size())));
      ++out.count;
    }
  }
  return out;
}

ElasticTrainer::ElasticTrainer(model::GPT2LMHeadModel model, StepComposition composition, dp::DistOptions options,
                               dp::DistContext world, BatchSource batches, ElasticSettings settings,
                               TrainStepSettings step_settings, PositionSource position)
    : model_(std::move(model)),
      composition_(std::move(composition)),
      options_(std::move(options)),
      first_world_(world),
      world_(std::move(world)),
      batches_(std::move(batches)),
      settings_(settings),
      step_settings_(std::move(step_settings)),
      position_(std::move(position)),
      launch_rank_(settings.join_id >= 0 ? settings.join_id : first_world_.rank) {
  for (const auto& item : model_->named_parameters()) shapes_.push_back(item.value().sizes().vec());
  const parallel::LayoutSizes& sizes = settings_.sizes;
  if (sizes.zero_stage != 0 || composition_.data_parallel.zero_stage != 0) {
    throw std::invalid_argument("elastic training: a lost rank's ZeRO shard exists nowhere else (use ZeRO stage 0)");
  }
  if ((sizes.tensor > 1) != (model_->tensor_parallel() != nullptr)) {
    throw std::invalid_argument("elastic training: the layout's tensor-parallel size " + std::to_string(sizes.tensor) +
                                " and the model " + (model_->tensor_parallel() ? "split" : "whole") + " disagree");
  }
  if ((sizes.pipeline > 1) != composition_.stages.has_value()) {
    throw std::invalid_argument("elastic training: " + std::to_string(sizes.pipeline) +
                                " pipeline stages in the layout, and the step's stage options " +
                                (composition_.stages ? "given" : "missing"));
  }
  if (sizes.tensor * sizes.context * sizes.pipeline > 1 && (settings_.accept_joiners || settings_.join_id >= 0)) {
    throw std::invalid_argument("elastic training: replacements join replicas of one process so far, not of " +
                                std::to_string(sizes.tensor * sizes.context * sizes.pipeline) + " processes");
  }
  membership_ = parallel::initial_membership(first_world_.world_size, sizes);
  if (settings_.min_replicas < 1 || settings_.min_replicas > membership_.original_replicas) {
    throw std::invalid_argument("--min_replicas " + std::to_string(settings_.min_replicas) + ": expected 1 to " +
                                std::to_string(membership_.original_replicas) + " (the data-parallel size)");
  }
  // A replacement's world rank is the lost process's: its replica.
  replica_ = membership_.layout().coordinates_of(first_world_.rank).data;
  if (settings_.join_id >= 0) {
    join();
    return;
  }
  generation_.number = 0;
  for (int r = 0; r < first_world_.world_size; ++r) generation_.members.push_back(r);
  // The world's own group serves generation 0; the groups composed over it are the trainer's own,
  // under keys of their own (the program may have made groups of the same names before).
  world_.store = c10::make_intrusive<c10d::PrefixStore>("elastic/generation 0", first_world_.store);
  compose();
}

namespace {

std::string ranks_list(const std::vector<int>& ranks) {
  std::string text;
  for (const int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

}  // namespace

ElasticTrainer::HeldState ElasticTrainer::hold_and_release() {
  HeldState held{step_->optimizer().local_state(), step_->learning_rate()};
  step_.reset();  // its synchronizer's hooks leave the parameters first
  sync_.reset();
  groups_ = parallel::ProcessGroups{};
  if (generation_.number > 0) world_.group.reset();  // the first generation's stays with first_world_
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& item : model_->named_parameters()) {
    at::Tensor p = item.value();
    const std::vector<int64_t>& shape = shapes_.at(i++);
    if (p.sizes() != at::IntArrayRef(shape)) p.set_data(at::empty(shape, p.options()));
  }
  return held;
}

void ElasticTrainer::enter(const dp::Generation& next, const std::vector<int>& order,
                           const parallel::Membership& membership, const HeldState& held) {
  world_ = dp::connect_generation(first_world_, next, order, launch_rank_, options_);
  // Its members are those that train in it: a process that checked in but whose replica was
  // dropped (another stage of it lost) leaves.
  generation_ = next;
  generation_.members = order;
  membership_ = membership;
  compose();
  step_->optimizer().load_local_state(held.optimizer);
  step_->set_learning_rate(held.learning_rate);
}

std::vector<int> ElasticTrainer::staying_members_in_order(const parallel::MembershipChange& change) const {
  std::vector<int> order(change.next.layout().world_size(), -1);
  for (size_t i = 0; i < generation_.members.size(); ++i) {
    const int rank = change.rank_in_next.at(i);
    if (rank >= 0) order.at(rank) = generation_.members[i];
  }
  return order;
}

int64_t ElasticTrainer::share_state(int64_t step, bool load) {
  torch::NoGradGuard no_grad;
  const c10::Device device = world_.device.torch_device();
  const bool sender = world_.rank == 0;
  auto broadcast = [&](at::Tensor& t) {
    std::vector<at::Tensor> tensors{t};
    world_.group->broadcast(tensors)->wait();
  };
  const auto parameters = model_->named_parameters();
  OptimizerState state = sender ? step_->optimizer_state() : OptimizerState{};
  // The step, the learning rate, the data position, and each parameter's AdamW step count (0: not
  // stepped yet). (Counts as doubles: exact below 2^53.)
  const DataPosition at = sender && position_ ? position_() : DataPosition{};
  std::vector<double> header{static_cast<double>(step), step_->learning_rate(), static_cast<double>(at.epoch),
                             static_cast<double>(at.batch)};
  for (const auto& item : parameters) {
    const auto it = state.find(item.key());
    header.push_back(it == state.end() ? 0.0 : static_cast<double>(it->second.step));
  }
  at::Tensor head = torch::tensor(header, torch::kFloat64).to(device);
  broadcast(head);
  head = head.cpu();
  const double* h = head.data_ptr<double>();
  model::NamedTensors weights;
  size_t i = 4;
  for (const auto& item : parameters) {
    at::Tensor w = item.value().detach().clone();
    broadcast(w);
    weights.emplace_back(item.key(), w.cpu());
    const int64_t steps = static_cast<int64_t>(h[i++]);
    if (steps == 0) continue;
    AdamWParamState& mine = state[item.key()];
    at::Tensor avg = sender ? mine.exp_avg.to(device) : torch::zeros_like(item.value(), torch::kFloat32).to(device);
    at::Tensor avg_sq = sender ? mine.exp_avg_sq.to(device) : torch::zeros_like(item.value(), torch::kFloat32).to(device);
    broadcast(avg);
    broadcast(avg_sq);
    mine.step = steps;
    mine.exp_avg = avg.cpu();
    mine.exp_avg_sq = avg_sq.cpu();
  }
  if (load) {
    step_->load_state(weights, state);
    step_->set_learning_rate(h[1]);
    joined_at_position_ = {static_cast<int64_t>(h[2]), static_cast<int64_t>(h[3])};
  }
  return static_cast<int64_t>(h[0]);
}

void ElasticTrainer::join() {
  c10d::Store& store = *first_world_.store;
  // The askers before it were admitted before it (or wait for a later loss): as its rank 0 would.
  admitted_ = dp::ask_to_join(store, launch_rank_);
  generation_ = dp::await_admission(store, launch_rank_, settings_.admission_timeout);
  membership_.generation = generation_.number;
  membership_.replicas = generation_.replicas;
  std::sort(membership_.replicas.begin(), membership_.replicas.end());
  world_ = dp::connect_generation(first_world_, generation_, generation_.members, launch_rank_, options_);
  compose();
  joined_at_step_ = share_state(0, /*load=*/true);
  just_joined_ = true;
  events_.push_back({generation_.number, joined_at_step_ + 1, membership_.replica_count(), {}, {launch_rank_}});
}

void ElasticTrainer::admit_joiners(int64_t k) {
  c10d::Store& store = *first_world_.store;
  const int64_t asked = world_.rank == 0 ? static_cast<int64_t>(dp::joins_after(store, admitted_).size()) : 0;
  at::Tensor count = torch::tensor({asked}, torch::kLong).to(world_.device.torch_device());
  std::vector<at::Tensor> tensors{count};
  world_.group->broadcast(tensors)->wait();
  const int64_t n = count.cpu().item<int64_t>();
  if (n == 0) return;
  // The dropped replicas, in order, take the askers in the order they asked; askers beyond them
  // wait for a later loss.
  std::vector<int> dropped;
  for (int r = 0; r < membership_.original_replicas; ++r) {
    if (membership_.member_index(r) < 0) dropped.push_back(r);
  }
  std::vector<int> asking = dp::joins_after(store, admitted_);
  asking.resize(static_cast<size_t>(std::min<int64_t>(n, static_cast<int64_t>(dropped.size()))));
  if (asking.empty()) return;
  dropped.resize(asking.size());
  const auto start = std::chrono::steady_clock::now();
  const parallel::MembershipChange change = parallel::rejoin_replicas(membership_, dropped);
  std::vector<int> order = staying_members_in_order(change);
  for (size_t j = 0; j < asking.size(); ++j) order.at(change.next.member_index(dropped[j])) = asking[j];
  const std::vector<int>& replicas = change.next.replicas;
  dp::Generation next{generation_.number + 1, order, replicas};
  const bool decider = world_.rank == 0;
  const HeldState held = hold_and_release();
  try {
    if (decider) next = dp::admit(store, generation_, order, replicas);
    admitted_ += static_cast<int>(asking.size());
    enter(next, order, change.next, held);
    (void)share_state(k, /*load=*/false);
  } catch (const std::exception& e) {
    // The state is no longer held by a step to recover from (a loss while growing back).
    throw AdmissionError("elastic: admitting process " + ranks_list(asking) + " at step " + std::to_string(k + 1) +
                         " failed, and the run cannot go on: " + e.what());
  }
  events_.push_back({next.number, k + 1, membership_.replica_count(), {}, asking});
  if (world_.rank != 0) return;
  std::cerr << "elastic: generation " << next.number << " at step " << k + 1 << ": process"
            << (asking.size() > 1 ? "es " : " ") << ranks_list(asking) << " joined; " << membership_.replica_count()
            << " of " << membership_.original_replicas << " replicas go on (" << std::fixed << std::setprecision(3)
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
            << " s to admit and send the state)" << std::defaultfloat << std::endl;
}

ElasticTrainer::~ElasticTrainer() = default;

void ElasticTrainer::compose() {
  const parallel::Layout layout = membership_.layout();
  groups_ = parallel::make_process_groups(world_, options_, layout);
  // The split model's collectives go over the new generation's tensor group (the same ranks of
  // the replica); the context group is set by compose_step.
  if (model_->tensor_parallel() != nullptr) tp::reconnect_tensor_parallel_group(*model_->tensor_parallel(), groups_.tensor);
  StepParts parts = compose_step(model_, layout, groups_, composition_);
  sync_ = std::move(parts.sync);
  step_ = std::make_unique<GPT2TrainStep>(model_, std::move(parts.forward_backward), std::move(parts.optimizer),
                                          sync_.get(), step_settings_);
  step_->set_training(true);
  if (layout.pipeline_parallel_size() > 1) {
    // A stage's gradient all-reduce may succeed while another stage's fails: none may step before
    // every member got this far.
    step_->after_backward = [this] { dp::barrier(world_); };
  }
}

bool ElasticTrainer::keeps_the_log() const {
  const parallel::Layout original = parallel::initial_membership(first_world_.world_size, settings_.sizes).layout();
  int keeper = -1, lowest = membership_.original_replicas;
  for (const int member : generation_.members) {
    if (member >= first_world_.world_size || !original.reports(member)) continue;
    const int replica = original.coordinates_of(member).data;
    if (replica < lowest) {
      lowest = replica;
      keeper = member;
    }
  }
  return keeper == launch_rank_;
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
    try {
      // Its broadcast is where a loss shows first. A replacement's first step skips it: the others
      // took this boundary's decision when they admitted it.
      if (settings_.accept_joiners && !std::exchange(just_joined_, false)) admit_joiners(k);
    } catch (const AdmissionError&) {
      throw;
    } catch (const std::exception& e) {
      if (!is_communication_failure(e)) throw;
      std::cerr << "[process " << launch_rank_ << "] elastic: step " << k + 1 << "'s start failed in a collective ("
                << std::string(e.what()).substr(0, std::string(e.what()).find('\n')) << "); agreeing who is left"
                << std::endl;
      recover(k);
      continue;
    }
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
  // go over to the next generation's step as they are.
  const HeldState held = hold_and_release();
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
  const std::string lost_text = ranks_list(lost_processes);
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
  enter(next, staying_members_in_order(change), change.next, held);
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
