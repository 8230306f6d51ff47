// Agreeing on a new generation after a lost process (see elastic_rendezvous.h).
#include "harness/data_parallel/elastic_rendezvous.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <sstream>
#include <thread>

namespace harness::data_parallel {
namespace {

using Clock = std::chrono::steady_clock;

std::string generation_key(int generation, const std::string& what) {
  return "elastic/gen" + std::to_string(generation) + "/" + what;
}

std::vector<uint8_t> encode(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? "," : "") + std::to_string(ranks[i]);
  return {text.begin(), text.end()};
}

std::vector<int> decode(const std::vector<uint8_t>& bytes) {
  std::vector<int> out;
  std::stringstream in(std::string(bytes.begin(), bytes.end()));
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoi(item));
  return out;
}

std::string ranks_text(const std::vector<int>& ranks) {
  const std::vector<uint8_t> bytes = encode(ranks);
  return "{" + std::string(bytes.begin(), bytes.end()) + "}";
}

}  // namespace

int Generation::rank_of(int launch_rank) const {
  const auto it = std::find(members.begin(), members.end(), launch_rank);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

std::string lost_process_key(int launch_rank) { return "elastic/lost/" + std::to_string(launch_rank); }

std::string recovered_key(int launch_rank) { return "elastic/recovered/" + std::to_string(launch_rank); }

std::string admitted_key(int launch_id) { return "elastic/admitted/" + std::to_string(launch_id); }

std::string admissions_closed_key() { return "elastic/closed"; }

std::string heartbeat_key(int launch_rank) { return "elastic/heartbeat/" + std::to_string(launch_rank); }

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int launch_rank, std::chrono::milliseconds period)
    : store_(std::move(store)), key_(heartbeat_key(launch_rank)), period_(period) {
  thread_ = std::thread([this] { beat(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void Heartbeat::beat() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      store_->add(key_, 1);
    } catch (const std::exception&) {
      return;  // the store is gone or unreachable: no beat can be heard anyway
    }
    lock.lock();
    stop_cv_.wait_for(lock, period_, [this] { return stop_; });
  }
}

bool LossWatch::lost(c10d::Store& store, int member) {
  if (store.check({lost_process_key(member)})) return true;
  const std::string key = heartbeat_key(member);
  if (!store.check({key})) return false;  // it never beat: the launcher watches it
  const int64_t count = store.add(key, 0);
  const Clock::time_point now = Clock::now();
  auto [it, first] = seen_.try_emplace(member, Seen{count, now});
  if (!first && it->second.count != count) it->second = Seen{count, now};
  return now - it->second.since >= stale_after_;
}

Generation agree_next_generation(c10d::Store& store, const Generation& now, int launch_rank,
                                 std::chrono::milliseconds join_window) {
  Generation next;
  next.number = now.number + 1;
  const auto key = [&](const std::string& what) { return generation_key(next.number, what); };
  store.set(key("alive/" + std::to_string(launch_rank)), std::vector<uint8_t>{1});
  if (store.add(key("decider"), 1) == 1) {
    // Every member of `now` checked in or known lost, or the window over: the ones in are next.
    const Clock::time_point deadline = Clock::now() + join_window;
    std::vector<int> in;
    LossWatch losses;
    for (;;) {
      in.clear();
      bool all_known = true;
      for (const int member : now.members) {
        if (store.check({key("alive/" + std::to_string(member))})) {
          in.push_back(member);
        } else if (!losses.lost(store, member)) {
          all_known = false;
        }
      }
      if (all_known || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    store.set(key("members"), encode(in));
  }
  try {
    // The decider may take the whole window (and the store's own timeout may be shorter).
    store.wait({key("members")}, join_window + std::chrono::seconds(30));
    next.members = decode(store.get(key("members")));
  } catch (const std::exception& e) {
    throw std::runtime_error("elastic: process " + std::to_string(launch_rank) + " waited for generation " +
                             std::to_string(next.number) + "'s members, and no decision came (" +
                             std::string(e.what()).substr(0, std::string(e.what()).find('\n')) + ")");
  }
  if (next.rank_of(launch_rank) < 0) {
    throw DeadGenerationError("elastic: process " + std::to_string(launch_rank) + " belongs to generation " +
                              std::to_string(now.number) + ", and generation " + std::to_string(next.number) +
                              " went on without it (members " + ranks_text(next.members) +
                              "); it must not train, and exits");
  }
  return next;
}

namespace {

std::string step_key(const Generation& now, int64_t step, const std::string& what) {
  return generation_key(now.number, "step" + std::to_string(step) + "/" + what);
}

const std::string kCommit = "commit";
const std::string kRetake = "retake";

StepDecision decision_of(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end()) == kCommit ? StepDecision::kCommit : StepDecision::kRetake;
}

// Proposes `proposal` as the step's decision: the one that stands (this one, unless one was set).
StepDecision decide(c10d::Store& store, const std::string& key, const std::string& proposal) {
  return decision_of(store.compareSet(key, {}, std::vector<uint8_t>(proposal.begin(), proposal.end())));
}

std::string step_text(const Generation& now, int64_t step) {
  return "step " + std::to_string(step + 1) + " of generation " + std::to_string(now.number);
}

}  // namespace

StepDecision vote_to_commit(c10d::Store& store, const Generation& now, int64_t step, int launch_rank,
                            std::chrono::milliseconds timeout) {
  const std::string decision = step_key(now, step, "decision");
  if (store.add(step_key(now, step, "votes"), 1) == static_cast<int64_t>(now.members.size())) {
    const StepDecision out = decide(store, decision, kCommit);
    if (out == StepDecision::kCommit && step > 0) {
      // Every member voted on this step, so every member has read the step before's decision.
      store.deleteKey(step_key(now, step - 1, "votes"));
      store.deleteKey(step_key(now, step - 1, "decision"));
    }
    return out;
  }
  // Polled, not waited on: a member recorded lost must be noticed too. The members vote within a
  // moment of each other (their last collective ends together), so the first pauses are short.
  const Clock::time_point start = Clock::now();
  Clock::time_point next_lost_check = start;
  LossWatch losses;
  for (auto pause = std::chrono::microseconds(50);; pause = std::min(2 * pause, std::chrono::microseconds(1000))) {
    if (store.check({decision})) return decision_of(store.get(decision));
    const Clock::time_point now_time = Clock::now();
    if (now_time >= next_lost_check) {
      for (const int member : now.members) {
        if (member != launch_rank && losses.lost(store, member)) return decide(store, decision, kRetake);
      }
      next_lost_check = now_time + std::chrono::milliseconds(20);
    }
    if (now_time - start > timeout) {
      throw std::runtime_error("elastic: process " + std::to_string(launch_rank) + " voted to commit " +
                               step_text(now, step) + ", and within " + std::to_string(timeout.count()) +
                               " ms no decision came and no member was recorded lost");
    }
    std::this_thread::sleep_for(pause);
  }
}

void call_off_step(c10d::Store& store, const Generation& now, int64_t step, int launch_rank) {
  if (decide(store, step_key(now, step, "decision"), kRetake) == StepDecision::kCommit) {
    throw std::logic_error("elastic: process " + std::to_string(launch_rank) + " called off " + step_text(now, step) +
                           ", which had committed without its vote");
  }
}

int ask_to_join(c10d::Store& store, const JoinRequest& request) {
  const int64_t n = store.add("elastic/joins", 1);
  const std::string text = std::to_string(request.launch_id) + " " + std::to_string(request.rank);
  store.set("elastic/join/" + std::to_string(n), std::vector<uint8_t>(text.begin(), text.end()));
  return static_cast<int>(n);
}

int join_count(c10d::Store& store) { return static_cast<int>(store.add("elastic/joins", 0)); }

std::vector<JoinRequest> joins_after(c10d::Store& store, int skipped) {
  const int64_t asked = join_count(store);
  std::vector<JoinRequest> out;
  for (int64_t n = skipped + 1; n <= asked; ++n) {
    const std::string key = "elastic/join/" + std::to_string(n);
    // Counted before its request was written: the asker is between the two calls (a later boundary
    // reads it), or died there.
    if (!store.check({key})) continue;
    const std::vector<uint8_t> bytes = store.get(key);
    const std::string text(bytes.begin(), bytes.end());
    const size_t space = text.find(' ');
    out.push_back({std::stoi(text.substr(0, space)), std::stoi(text.substr(space + 1)), static_cast<int>(n)});
  }
  return out;
}

Generation admit(c10d::Store& store, const Generation& now, const std::vector<int>& members,
                 const std::vector<int>& replicas) {
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw std::invalid_argument("elastic: generation " + std::to_string(now.number + 1) + "'s members " +
                                ranks_text(members) + " repeat a process");
  }
  if (replicas.size() != members.size()) {
    throw std::invalid_argument("elastic: generation " + std::to_string(now.number + 1) + ": " +
                                std::to_string(replicas.size()) + " replicas for " + std::to_string(members.size()) +
                                " members");
  }
  Generation next{now.number + 1, members, replicas, {}};
  for (const int member : members) {
    if (now.rank_of(member) < 0) next.joined.push_back(member);
  }
  store.set(generation_key(next.number, "replicas"), encode(replicas));
  store.set(generation_key(next.number, "joined"), encode(next.joined));
  store.set(generation_key(next.number, "members"), encode(members));
  const std::string number = std::to_string(next.number);
  for (const int member : next.joined) {
    store.set(admitted_key(member), std::vector<uint8_t>(number.begin(), number.end()));
  }
  return next;
}

Generation await_admission(c10d::Store& store, int launch_id, std::chrono::milliseconds timeout) {
  const std::string key = admitted_key(launch_id);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Polled, not waited on: the launcher may close admissions instead (the run ended).
  for (auto pause = std::chrono::milliseconds(1); !store.check({key});
       pause = std::min(2 * pause, std::chrono::milliseconds(50))) {
    if (store.check({admissions_closed_key()})) {
      throw RunEndedError("elastic: process " + std::to_string(launch_id) +
                          " asked to join, and the run ended before the others reached a step boundary to admit it");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("elastic: process " + std::to_string(launch_id) +
                               " asked to join and was not admitted within " + std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(pause);
  }
  const std::vector<uint8_t> number = store.get(key);
  Generation out;
  out.number = std::stoi(std::string(number.begin(), number.end()));
  out.members = decode(store.get(generation_key(out.number, "members")));
  out.replicas = decode(store.get(generation_key(out.number, "replicas")));
  out.joined = decode(store.get(generation_key(out.number, "joined")));
  return out;
}

DistContext connect_generation(const DistContext& world, const Generation& generation,
                               const std::vector<int>& members, int launch_rank, const DistOptions& options) {
  const int rank = Generation{generation.number, members, {}, {}}.rank_of(launch_rank);
  if (rank < 0) {
    throw std::invalid_argument("connect_generation: process " + std::to_string(launch_rank) + " is not among " +
                                ranks_text(members));
  }
  DistContext out = world;
  out.rank = rank;
  out.world_size = static_cast<int>(members.size());
  // Each connection's keys are its own (the generation and the members), and so are those of the
  // groups built from it (process_groups.h prefixes the world's store).
  const std::string prefix = generation_key(generation.number, "group" + ranks_text(members));
  out.store = c10::make_intrusive<c10d::PrefixStore>(prefix, world.store);
  DistOptions o = options;
  o.rank = out.rank;
  o.world_size = out.world_size;
  o.group_name = "generation " + std::to_string(generation.number) + "'s group";
  out.group = create_backend(world.backend, c10::make_intrusive<c10d::PrefixStore>("world", out.store), out.rank,
                             out.world_size, o);
  return out;
}

}  // namespace harness::data_parallel
