// Steps that survive a lost replica (see elastic_trainer.h).
#include "harness/train/elastic/elastic_trainer.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iomanip>
#include <map>
#include <sstream>
#include <algorithm>
#include <utility>
#include <iostream>
#include <stdexcept>
#include <string>

#include "harness/tensor_parallel/group.h"
#include "harness/train/elastic/elastic_batches.h"

namespace harness::train {

namespace dp = harness::data_parallel;
namespace tp = harness::tensor_parallel;

void kill_here_if_asked(int launch_rank, int64_t step, bool at_the_vote) {
  const char* hook = std::getenv("HARNESS_TEST_KILL_AT_STEP");
  if (hook == nullptr) return;
  std::stringstream items(hook);
  for (std::string item; std::getline(items, item, ',');) {
    std::stringstream fields(item);
    std::string rank, at, how;
    std::getline(fields, rank, ':');
    std::getline(fields, at, ':');
    std::getline(fields, how, ':');
    if (rank.empty() || at.empty() || std::atoi(rank.c_str()) != launch_rank || std::atoll(at.c_str()) != step ||
        (how == "vote") != at_the_vote) {
      continue;
    }
    const bool stop = how == "stop";
    std::cerr << "[process " << launch_rank << "] test hook: " << (stop ? "stopped" : "killed")
              << (at_the_vote ? " before its vote on step " : " at step ") << step << std::endl;
    std::raise(stop ? SIGSTOP : SIGKILL);
  }
}

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
  const Plan& plan = settings_.plan;
  if ((plan.tensor_parallel_size > 1) != (model_->tensor_parallel() != nullptr)) {
    throw std::invalid_argument("elastic training: the layout's tensor-parallel size " +
                                std::to_string(plan.tensor_parallel_size) + " and the model " +
                                (model_->tensor_parallel() ? "split" : "whole") + " disagree");
  }
  if ((plan.pipeline_parallel_size > 1) != composition_.stages.has_value()) {
    throw std::invalid_argument("elastic training: " + std::to_string(plan.pipeline_parallel_size) +
                                " pipeline stages in the layout, and the step's stage options " +
                                (composition_.stages ? "given" : "missing"));
  }
  membership_ = parallel::initial_membership(first_world_.world_size, plan.layout_sizes());
  if (plan.min_replicas < 1 || plan.min_replicas > membership_.original_replicas) {
    throw std::invalid_argument("--min_replicas " + std::to_string(plan.min_replicas) + ": expected 1 to " +
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
  // Generation 0's groups are the trainer's own, not the program's (made over the same world):
  // letting them go after a loss closes their connections, so that a survivor blocked in a
  // collective with this one (not with the lost process) fails at once instead of at the timeout.
  world_ = dp::connect_generation(first_world_, generation_, generation_.members, launch_rank_, options_);
  compose(0);
}

namespace {

// Test hook HARNESS_TEST_LOSE_REPLACEMENT=<launch id>: that replacement is killed (SIGKILL) once
// admitted and connected, before it receives the state: a process lost during an admission.
void lose_this_replacement_if_asked(int launch_id) {
  const char* hook = std::getenv("HARNESS_TEST_LOSE_REPLACEMENT");
  if (hook == nullptr || *hook == '\0' || std::atoi(hook) != launch_id) return;
  std::cerr << "[process " << launch_id << "] test hook: killed while being admitted" << std::endl;
  std::raise(SIGKILL);
}

std::string ranks_list(const std::vector<int>& ranks) {
  std::string text;
  for (const int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

}  // namespace

ElasticTrainer::HeldState ElasticTrainer::hold_and_release() {
  HeldState held{step_->optimizer().local_state(), step_->learning_rate()};
  release();
  return held;
}

void ElasticTrainer::release() {
  step_.reset();  // its synchronizer's hooks leave the parameters first
  sync_.reset();
  groups_ = parallel::ProcessGroups{};
  world_.group.reset();
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& item : model_->named_parameters()) {
    at::Tensor p = item.value();
    const std::vector<int64_t>& shape = shapes_.at(i++);
    if (p.sizes() != at::IntArrayRef(shape)) p.set_data(at::empty(shape, p.options()));
  }
}

void ElasticTrainer::enter(const dp::Generation& next, const std::vector<int>& order,
                           const parallel::Membership& membership, const HeldState& held, int64_t step) {
  world_ = dp::connect_generation(first_world_, next, order, launch_rank_, options_);
  // Its members are those that train in it: a process that checked in but whose replica was
  // dropped (another stage of it lost) leaves.
  generation_ = next;
  generation_.members = order;
  membership_ = membership;
  compose(step);
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
  const dp::DistContext& replicas = groups_.data;  // the ranks at this rank's place in every replica
  const c10::Device device = replicas.device.torch_device();
  // The sender: the group's first rank that holds the state.
  at::Tensor first = torch::tensor({static_cast<int64_t>(load ? replicas.world_size : replicas.rank)}, torch::kLong)
                         .to(device);
  {
    std::vector<at::Tensor> tensors{first};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    replicas.group->allreduce(tensors, min)->wait();
  }
  const int root = static_cast<int>(first.cpu().item<int64_t>());
  if (root >= replicas.world_size) throw std::logic_error("elastic: no member at this place holds the state");
  const bool sender = replicas.rank == root;
  auto broadcast = [&](at::Tensor& t) {
    std::vector<at::Tensor> tensors{t};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    replicas.group->broadcast(tensors, options)->wait();
  };
  // What this rank holds: its stages' parameters (the others are empty here), its tensor slices.
  std::vector<std::pair<std::string, at::Tensor>> held;
  for (const auto& item : model_->named_parameters()) {
    if (item.value().numel() > 0) held.emplace_back(item.key(), item.value());
  }
  OptimizerState state = sender ? step_->optimizer().local_state() : OptimizerState{};
  // The step, the learning rate, the data position, and each parameter's AdamW step count (0: not
  // stepped yet). (Counts as doubles: exact below 2^53.)
  const DataPosition at = sender && position_ ? position_() : DataPosition{};
  std::vector<double> header{static_cast<double>(step), step_->learning_rate(), static_cast<double>(at.epoch),
                             static_cast<double>(at.batch)};
  const size_t fields = header.size();
  for (const auto& [name, p] : held) {
    const auto it = state.find(name);
    header.push_back(it == state.end() ? 0.0 : static_cast<double>(it->second.step));
  }
  at::Tensor head = torch::tensor(header, torch::kFloat64).to(device);
  broadcast(head);
  head = head.cpu();
  const double* h = head.data_ptr<double>();
  OptimizerState received;
  for (size_t i = 0; i < held.size(); ++i) {
    const auto& [name, p] = held[i];
    at::Tensor w = p.detach().clone();
    broadcast(w);
    if (load) p.detach().copy_(w);
    const int64_t steps = static_cast<int64_t>(h[fields + i]);
    if (steps == 0) continue;
    at::Tensor avg, avg_sq;
    if (sender) {
      const AdamWParamState& mine = state.at(name);
      if (mine.exp_avg.sizes() != p.sizes()) {
        throw std::logic_error("elastic: the AdamW state of " + name + " is not shaped as its parameter here");
      }
      avg = mine.exp_avg.to(device, torch::kFloat32).contiguous();
      avg_sq = mine.exp_avg_sq.to(device, torch::kFloat32).contiguous();
    } else {
      avg = torch::zeros(p.sizes(), p.options().dtype(torch::kFloat32));
      avg_sq = torch::zeros(p.sizes(), p.options().dtype(torch::kFloat32));
    }
    broadcast(avg);
    broadcast(avg_sq);
    received[name] = {steps, avg, avg_sq};
  }
  if (load) {
    step_->optimizer().load_local_state(received);
    step_->set_learning_rate(h[1]);
    joined_at_position_ = {static_cast<int64_t>(h[2]), static_cast<int64_t>(h[3])};
  }
  return static_cast<int64_t>(h[0]);
}

void ElasticTrainer::join() {
  c10d::Store& store = *first_world_.store;
  (void)dp::ask_to_join(store, {launch_rank_, first_world_.rank});
  generation_ = dp::await_admission(store, launch_rank_, settings_.admission_timeout);
  membership_.generation = generation_.number;
  membership_.replicas = generation_.replicas;
  std::sort(membership_.replicas.begin(), membership_.replicas.end());
  membership_.replicas.erase(std::unique(membership_.replicas.begin(), membership_.replicas.end()),
                             membership_.replicas.end());
  world_ = dp::connect_generation(first_world_, generation_, generation_.members, launch_rank_, options_);
  // Dropout streams of its own, the same on every stage of its replica (admitted together), and
  // unlike any original replica's (seed + d) or any other replacement's.
  if (composition_.stages) {
    composition_.stages->seed += static_cast<uint64_t>(generation_.number) * membership_.original_replicas;
  }
  compose(0);  // the driver sets the step it joins at
  lose_this_replacement_if_asked(launch_rank_);
  joined_at_step_ = share_state(0, /*load=*/true);
  just_joined_ = true;
  events_.push_back({generation_.number, joined_at_step_ + 1, membership_.replica_count(), {}, generation_.joined});
}

std::vector<dp::JoinRequest> ElasticTrainer::choose_joiners() {
  c10d::Store& store = *first_world_.store;
  if (dp::join_count(store) <= settled_requests_) return {};  // nobody new (one store call a step)
  std::map<int, dp::JoinRequest> latest;  // by the rank asked for
  bool settled = true;                    // every request so far, with no gap
  for (const dp::JoinRequest& request : dp::joins_after(store, settled_requests_)) {
    settled = settled && request.number == settled_requests_ + 1;
    // Admitted already, or lost while waiting (another replacement may ask for its rank).
    if (store.check({dp::admitted_key(request.launch_id)}) || store.check({dp::lost_process_key(request.launch_id)})) {
      if (settled) settled_requests_ = request.number;
      continue;
    }
    settled = false;
    latest[request.rank] = request;
  }
  std::vector<int> asked;
  for (const auto& item : latest) asked.push_back(item.first);
  const std::vector<int> replicas = parallel::complete_replicas(membership_, asked);
  const parallel::Layout original = membership_.original_layout();
  std::vector<dp::JoinRequest> chosen;
  for (const auto& [rank, request] : latest) {
    const int replica = original.coordinates_of(rank).data;
    if (std::find(replicas.begin(), replicas.end(), replica) != replicas.end()) chosen.push_back(request);
  }
  return chosen;
}

namespace {

// Rank 0's choice of replacements (`chosen`, empty elsewhere) to every member: their launch ids
// and the ranks they take, empty when none. Sent as [count, launch ids..., ranks...] (at most
// `most` of them) summed with the others' zeros: an all-reduce, not a broadcast, so that no member
// gets past it without every member's part, and a member lost between steps fails it on all of
// them at once (after a broadcast, a member that had rank 0's part would train the step before it
// noticed).
struct Joiners {
  std::vector<int> asking, ranks;
};
Joiners agree_on_joiners(const dp::DistContext& world, int most, const std::vector<dp::JoinRequest>& chosen) {
  std::vector<int64_t> decision(1 + 2 * static_cast<size_t>(most), 0);
  decision[0] = static_cast<int64_t>(chosen.size());
  for (size_t j = 0; j < chosen.size(); ++j) {
    decision[1 + j] = chosen[j].launch_id;
    decision[1 + most + j] = chosen[j].rank;
  }
  at::Tensor told = torch::tensor(decision, torch::kLong).to(world.device.torch_device());
  std::vector<at::Tensor> tensors{told};
  world.group->allreduce(tensors)->wait();
  told = told.cpu();
  const int64_t* d = told.data_ptr<int64_t>();
  Joiners joiners;
  for (int64_t j = 0; j < d[0]; ++j) {
    joiners.asking.push_back(static_cast<int>(d[1 + j]));
    joiners.ranks.push_back(static_cast<int>(d[1 + most + j]));
  }
  return joiners;
}

}  // namespace

void ElasticTrainer::admit_joiners(int64_t k) {
  c10d::Store& store = *first_world_.store;
  const Joiners joiners = agree_on_joiners(
      world_, first_world_.world_size, world_.rank == 0 ? choose_joiners() : std::vector<dp::JoinRequest>{});
  if (joiners.asking.empty()) return;
  const std::vector<int>& asking = joiners.asking;
  const std::vector<int>& ranks = joiners.ranks;
  const parallel::Layout original = membership_.original_layout();
  std::vector<int> rejoining;
  for (const int rank : ranks) rejoining.push_back(original.coordinates_of(rank).data);
  std::sort(rejoining.begin(), rejoining.end());
  rejoining.erase(std::unique(rejoining.begin(), rejoining.end()), rejoining.end());
  const auto start = std::chrono::steady_clock::now();
  const parallel::MembershipChange change = parallel::rejoin_replicas(membership_, rejoining);
  const parallel::Layout next_layout = change.next.layout();
  // Each replacement at its rank's place: its stage, tensor and context rank, in its replica.
  std::vector<int> order = staying_members_in_order(change);
  for (size_t j = 0; j < asking.size(); ++j) {
    parallel::Coordinates place = original.coordinates_of(ranks[j]);
    place.data = change.next.member_index(place.data);
    order.at(next_layout.rank_of(place)) = asking[j];
  }
  std::vector<int> replicas;  // each member's original replica, in rank order
  for (int rank = 0; rank < next_layout.world_size(); ++rank) {
    replicas.push_back(change.next.replicas.at(next_layout.coordinates_of(rank).data));
  }
  dp::Generation next{generation_.number + 1, order, replicas, {}};
  const bool decider = world_.rank == 0;
  const HeldState held = hold_and_release();
  try {
    if (decider) next = dp::admit(store, generation_, order, replicas);
    enter(next, order, change.next, held, k);
    (void)share_state(k, /*load=*/false);
  } catch (const std::exception& e) {
    if (!is_communication_failure(e)) {
      throw AdmissionError("elastic: admitting process " + ranks_list(asking) + " at step " + std::to_string(k + 1) +
                           " failed, and the run cannot go on: " + e.what());
    }
    // A process lost while admitting (a replacement, most likely). The admitted generation is
    // the one to recover from: its replacements hold no state yet and never check in, so their
    // replicas are dropped again with the lost process's, and the members go on from `held`.
    std::cerr << "[process " << launch_rank_ << "] elastic: admitting process" << (asking.size() > 1 ? "es " : " ")
              << ranks_list(asking) << " at step " << k + 1 << " failed in a collective ("
              << std::string(e.what()).substr(0, std::string(e.what()).find('\n')) << "); agreeing who is left"
              << std::endl;
    generation_ = next;
    generation_.members = order;
    membership_ = change.next;
    recover(k, held);
    return;
  }
  std::vector<int> joined;  // in rank order, as the record lists them
  for (const int member : order) {
    if (std::find(asking.begin(), asking.end(), member) != asking.end()) joined.push_back(member);
  }
  events_.push_back({next.number, k + 1, membership_.replica_count(), {}, joined});
  if (world_.rank != 0) return;
  std::cerr << "elastic: generation " << next.number << " at step " << k + 1 << ": process"
            << (joined.size() > 1 ? "es " : " ") << ranks_list(joined) << " joined; " << membership_.replica_count()
            << " of " << membership_.original_replicas << " replicas go on (" << std::fixed << std::setprecision(3)
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
            << " s to admit and send the state)" << std::defaultfloat << std::endl;
}

ElasticTrainer::~ElasticTrainer() = default;

void ElasticTrainer::compose(int64_t step) {
  RankContext rank;  // this generation's world, the run's sizes
  rank.plan = settings_.plan;
  rank.plan.world_size = membership_.layout().world_size();
  rank.rank = world_.rank;
  rank.groups = parallel::make_process_groups(world_, options_, rank.layout());
  groups_ = rank.groups;
  // The split model's collectives go over the new generation's tensor group (the same ranks of
  // the replica); the context group is set by build_step.
  BuiltStep built = build_step(
      rank,
      [this](std::shared_ptr<model::TensorParallelGroup>) {
        if (model_->tensor_parallel() != nullptr) {
          tp::reconnect_tensor_parallel_group(*model_->tensor_parallel(), groups_.tensor);
        }
        return model_;
      },
      composition_, step_settings_);
  sync_ = std::move(built.sync);
  step_ = std::move(built.plain);
  step_->set_training(true);
  step_->set_global_step(step);
  // A collective can end for some members and fail for others (a process lost in its middle; one
  // stage's all-reduce done, another's failed): no member updates its weights before all voted.
  step_->set_before_update([this] { commit_or_retake(); });
}

void ElasticTrainer::commit_or_retake() {
  kill_here_if_asked(launch_rank_, voting_step_ + 1, /*at_the_vote=*/true);
  const auto timeout = settings_.join_window + std::chrono::seconds(30);
  if (dp::vote_to_commit(*first_world_.store, generation_, voting_step_, launch_rank_, timeout) ==
      dp::StepDecision::kCommit) {
    return;
  }
  throw StepRetaken("elastic: step " + std::to_string(voting_step_ + 1) + " of generation " +
                    std::to_string(generation_.number) + " is taken again (a member's step failed, or a member was "
                    "lost before every member voted to commit it)");
}

void ElasticTrainer::announce_recovered() {
  if (left_behind_.empty()) return;
  // Set by every member (the same value each time): one may be lost before it gets here.
  const std::string generation = std::to_string(generation_.number);
  for (const int process : left_behind_) {
    first_world_.store->set(dp::recovered_key(process), std::vector<uint8_t>(generation.begin(), generation.end()));
  }
  left_behind_.clear();
}

void ElasticTrainer::call_off(int64_t k) { dp::call_off_step(*first_world_.store, generation_, k, launch_rank_); }

bool ElasticTrainer::keeps_the_log() const {
  // The reporting members (by their place in this generation's layout): of those that started
  // with the run the one of the lowest replica, else (every one of them lost) of the replacements.
  const parallel::Layout layout = membership_.layout();
  int keeper = -1;
  bool keeper_started_with_the_run = false;
  for (size_t rank = 0; rank < generation_.members.size(); ++rank) {
    if (!layout.reports(static_cast<int>(rank))) continue;
    const int member = generation_.members[rank];
    const bool started_with_the_run = member < first_world_.world_size;
    // Ranks go up with the replica: the first reporter of each kind is its lowest replica.
    if (keeper < 0 || (started_with_the_run && !keeper_started_with_the_run)) {
      keeper = member;
      keeper_started_with_the_run = started_with_the_run;
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
      call_off(k);
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
      voting_step_ = k;
      const double loss = step_->step(mine.batches, mine.loss_divisors);
      last_examples_ = example_digest(mine.batches);
      announce_recovered();
      return loss;
    } catch (const StepRetaken& e) {
      std::cerr << "[process " << launch_rank_ << "] " << e.what() << "; agreeing who is left" << std::endl;
    } catch (const std::exception& e) {
      if (!is_communication_failure(e)) throw;
      std::cerr << "[process " << launch_rank_ << "] elastic: step " << k + 1 << " failed in a collective ("
                << std::string(e.what()).substr(0, std::string(e.what()).find('\n')) << "); agreeing who is left"
                << std::endl;
      call_off(k);
    }
    recover(k);
  }
}

void ElasticTrainer::recover(int64_t k) {
  // The weights have not moved (no member updates them before every member voted to commit the
  // step); AdamW's state and rate go over to the next generation's step as they are.
  recover(k, hold_and_release());
}

void ElasticTrainer::recover(int64_t k, const HeldState& held) {
  const auto start = std::chrono::steady_clock::now();
  release();
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
  if (change.next.replica_count() < settings_.plan.min_replicas) {
    throw std::runtime_error("elastic: lost process " + lost_text + " at step " + std::to_string(k + 1) + "; " +
                             std::to_string(change.next.replica_count()) + " replica(s) left, below --min_replicas " +
                             std::to_string(settings_.plan.min_replicas));
  }
  const std::vector<int> order = staying_members_in_order(change);
  for (const int member : generation_.members) {
    if (std::find(order.begin(), order.end(), member) == order.end()) left_behind_.push_back(member);
  }
  enter(next, order, change.next, held, k);
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
