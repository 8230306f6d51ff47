// What the ranks of a run agree on before training (see rank_agreement.h).
#include "harness/train/rank_agreement.h"

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "harness/data_parallel/process_group.h"
#include "harness/train/checkpoint/checkpoint_store.h"
#include "harness/train/checkpoint/training_state.h"

namespace harness::train {
namespace {

namespace dp = harness::data_parallel;

const char* const kStopKey = "harness/stopped/";
const char* const kHostKey = "harness/host/";
const char* const kAnsweredKey = "harness/timed_out/";

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return out;
}

// What Gloo (and the TCP store) say when the process at the other end of a connection is gone.
bool is_peer_loss(const std::string& error) {
  for (const char* words : {"Connection closed by peer", "Connection reset by peer", "Broken pipe",
                            "Connection refused"}) {
    if (error.find(words) != std::string::npos) return true;
  }
  return false;
}

// What Gloo says when a collective waited past the process group's timeout.
bool is_timeout(const std::string& error) {
  return error.find("Timed out waiting") != std::string::npos ||
         error.find("timed out") != std::string::npos;
}

std::string seconds(std::chrono::milliseconds d) {
  std::ostringstream out;
  out << static_cast<double>(d.count()) / 1000.0 << " s";
  return out.str();
}

// What a thread that reads the store found, shared with the rank that waits on it.
struct StoreRound {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool reached = false;  // this rank's own key came back from the store
  bool done = false;
  std::set<int> answered;
  std::map<int, std::string> stopped;  // ranks that left a stop (record_stop): their message
  std::map<int, std::string> hosts;
};

void read_who_answered(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                       std::chrono::steady_clock::time_point deadline, std::shared_ptr<StoreRound> round) {
  auto finish = [&] {
    std::lock_guard<std::mutex> lock(round->mutex);
    round->done = true;
    round->done_cv.notify_all();
  };
  try {
    const std::string mine = kAnsweredKey + std::to_string(rank);
    store->set(mine, std::vector<uint8_t>{1});
    if (!store->check({mine})) throw std::runtime_error("the store lost this rank's key");
    {
      std::lock_guard<std::mutex> lock(round->mutex);
      round->reached = true;
      round->answered.insert(rank);
    }
    // Every rank behind the same failure says so within moments, or has stopped with a reason of its
    // own; the window bounds the wait for the others.
    for (;;) {
      std::set<int> seen{rank};
      std::map<int, std::string> stopped;
      for (int r = 0; r < world_size; ++r) {
        if (r == rank) continue;
        if (store->check({kAnsweredKey + std::to_string(r)})) {
          seen.insert(r);
        } else if (store->check({kStopKey + std::to_string(r)})) {
          const std::vector<uint8_t> said = store->get(kStopKey + std::to_string(r));
          stopped[r] = std::string(said.begin(), said.end());
        }
      }
      const bool all_known = seen.size() + stopped.size() == static_cast<size_t>(world_size);
      {
        std::lock_guard<std::mutex> lock(round->mutex);
        round->answered = seen;
        round->stopped = std::move(stopped);
      }
      if (all_known || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::map<int, std::string> hosts;
    for (int r = 0; r < world_size; ++r) {
      const std::string key = kHostKey + std::to_string(r);
      if (store->check({key})) {
        const std::vector<uint8_t> label = store->get(key);
        hosts[r] = std::string(label.begin(), label.end());
      }
    }
    std::lock_guard<std::mutex> lock(round->mutex);
    round->hosts = std::move(hosts);
  } catch (const std::exception&) {
    // A store that fails here is a store this rank cannot use: what was read so far stands.
  }
  finish();
}

// "rank 2 (host2 10.77.0.3)", or "ranks 0, 1 (host0 10.77.0.1; host1 10.77.0.2)".
std::string ranks_with_hosts(const std::vector<int>& ranks, const std::map<int, std::string>& hosts) {
  std::string out = rank_list(ranks);
  std::vector<std::string> labels;
  for (int r : ranks) {
    const auto it = hosts.find(r);
    const std::string label = it == hosts.end() ? "" : it->second;
    if (!label.empty() && std::find(labels.begin(), labels.end(), label) == labels.end()) labels.push_back(label);
  }
  if (labels.empty()) return out;
  out += " (";
  for (size_t i = 0; i < labels.size(); ++i) out += (i ? "; " : "") + labels[i];
  return out + ")";
}

}  // namespace

void record_host(const std::string& label, const dp::DistContext& world) {
  if (!world.store || world.world_size == 1) return;
  try {
    world.store->set(kHostKey + std::to_string(world.rank), std::vector<uint8_t>(label.begin(), label.end()));
  } catch (const std::exception&) {
    // Only the explanation of a later timeout would miss it.
  }
}

CollectiveDiagnosis explain_failed_collective(const std::string& error, const dp::DistContext& world,
                                              const std::string& own_host, const std::string& store_address,
                                              std::chrono::milliseconds window) {
  if (!world.store || world.world_size == 1 || !(is_timeout(error) || is_peer_loss(error))) return {error, true};
  const auto deadline = std::chrono::steady_clock::now() + window;
  auto round = std::make_shared<StoreRound>();
  // Detached: a store behind a cut link may never answer, and this rank must not wait on it.
  std::thread(read_who_answered, world.store, world.rank, world.world_size, deadline, round).detach();
  std::unique_lock<std::mutex> lock(round->mutex);
  const bool finished =
      round->done_cv.wait_until(lock, deadline + std::chrono::seconds(1), [&] { return round->done; });
  const std::string failed = is_timeout(error) ? "a collective timed out" : "a peer closed its connection";
  const std::string transport = " (Gloo: " + error.substr(0, error.find('\n')) + ")";
  if (!round->reached) {
    // Refused outright: the store's server (rank 0, or the launcher) is gone, not out of reach.
    if (finished) return {explain_stop(error, world), false};
    return {failed + ", and this rank (rank " + std::to_string(world.rank) + " on " + own_host +
                ") could not reach the rendezvous store at " + store_address + " within " + seconds(window) +
                " either: this host is cut off from rank 0's host (a cut link or a lost network), so the run "
                "cannot go on here" + transport,
            false};
  }
  if (!round->stopped.empty()) {
    const auto& [rank, said] = *round->stopped.begin();
    return {"rank " + std::to_string(rank) + " stopped, with: " + said + transport, true};
  }
  std::vector<int> silent, answered;
  for (int r = 0; r < world.world_size; ++r) {
    (round->answered.count(r) ? answered : silent).push_back(r);
  }
  if (silent.empty()) {
    return {failed + " on every rank, and every rank still reaches the store: a rank was too slow for "
            "--dist_timeout_s, or the ranks issued different collectives (--debug_sync checks that)" + transport,
            true};
  }
  return {failed + ": " + ranks_with_hosts(silent, round->hosts) + " did not answer through the rendezvous store at " +
              store_address + " within " + seconds(window) +
              ", so it is unreachable from here (a cut link, a lost host, or a stopped process); " +
              ranks_with_hosts(answered, round->hosts) + " answered" + transport,
          true};
}

bool store_reachable(const dp::DistContext& world, std::chrono::milliseconds window) {
  if (!world.store) return false;
  struct Probe {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false, reached = false;
  };
  auto probe = std::make_shared<Probe>();
  std::thread([store = world.store, rank = world.rank, probe] {
    bool reached = false;
    try {
      const std::string key = "harness/reachable/" + std::to_string(rank);
      store->set(key, std::vector<uint8_t>{1});
      reached = store->check({key});
    } catch (const std::exception&) {
    }
    std::lock_guard<std::mutex> lock(probe->mutex);
    probe->done = true;
    probe->reached = reached;
    probe->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(probe->mutex);
  probe->done_cv.wait_for(lock, window, [&] { return probe->done; });
  return probe->reached;
}

std::vector<std::string> all_gather_strings(const std::string& mine, const dp::DistContext* world) {
  if (world == nullptr || world->world_size == 1) return {mine};
  const c10::Device device = world->device.torch_device();
  auto gather = [&](const at::Tensor& local) {
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world->world_size; ++r) out[0].push_back(torch::empty_like(local));
    std::vector<at::Tensor> in{local};
    world->group->allgather(out, in)->wait();
    return out[0];
  };
  const std::vector<at::Tensor> lengths =
      gather(torch::full({1}, static_cast<int64_t>(mine.size()), torch::kLong).to(device));
  int64_t longest = 0;
  for (const at::Tensor& l : lengths) longest = std::max(longest, l.item<int64_t>());
  at::Tensor local = torch::zeros({std::max<int64_t>(longest, 1)}, torch::kUInt8);
  std::memcpy(local.data_ptr<uint8_t>(), mine.data(), mine.size());
  const std::vector<at::Tensor> all = gather(local.to(device));
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r) {
    out.push_back(tensor_to_bytes(all[r].to(torch::kCPU).narrow(0, 0, lengths[r].item<int64_t>())));
  }
  return out;
}

void agree_to_go_on(const std::string& refusal, const dp::DistContext* world) {
  const std::vector<std::string> reasons = all_gather_strings(refusal, world);
  std::vector<int> refused;
  for (size_t r = 0; r < reasons.size(); ++r) {
    if (!reasons[r].empty()) refused.push_back(static_cast<int>(r));
  }
  if (refused.empty()) return;
  std::string message = rank_list(refused) + " refused to start, so no rank starts: ";
  // The same reason from several ranks (a folder they share, the same flags) is said once.
  std::map<std::string, std::vector<int>> by_reason;
  for (int r : refused) by_reason[reasons[static_cast<size_t>(r)]].push_back(r);
  bool first = true;
  for (const auto& [reason, ranks] : by_reason) {
    message += (first ? "" : "; ") + (by_reason.size() > 1 ? rank_list(ranks) + ": " : std::string()) + reason;
    first = false;
  }
  throw AgreedStop(message);
}

TokenizerFingerprint tokenizer_fingerprint(const std::vector<data::TranslationExample>& train,
                                           const std::string& tokenizer_path) {
  std::string text;
  for (const data::TranslationExample& example : train) {
    // Lengths first, so that no two different lists of pairs make the same text.
    text += std::to_string(example.de.size()) + ":" + example.de + std::to_string(example.en.size()) + ":" +
            example.en;
  }
  return {sha256_hex(text.data(), text.size()), sha256_file(tokenizer_path)};
}

void check_ranks_share_tokenizer(const TokenizerFingerprint& mine, const dp::DistContext* world) {
  const std::vector<std::string> all = all_gather_strings(mine.training_pairs + " " + mine.tokenizer_model, world);
  // Each rank's "<pairs hash> <tokenizer hash>" back into its two hashes.
  auto fingerprint_of = [&](size_t r) {
    const size_t space = all[r].find(' ');
    return TokenizerFingerprint{all[r].substr(0, space), all[r].substr(space + 1)};
  };
  const TokenizerFingerprint rank0 = fingerprint_of(0);
  std::vector<int> other_pairs, other_tokenizer;
  for (size_t r = 1; r < all.size(); ++r) {
    const TokenizerFingerprint theirs = fingerprint_of(r);
    if (theirs.training_pairs != rank0.training_pairs) {
      other_pairs.push_back(static_cast<int>(r));
    } else if (theirs.tokenizer_model != rank0.tokenizer_model) {
      other_tokenizer.push_back(static_cast<int>(r));
    }
  }
  if (other_pairs.empty() && other_tokenizer.empty()) return;
  std::string message = "the ranks do not share one tokenizer, so they would train on different ids: ";
  if (!other_pairs.empty()) {
    message += rank_list(other_pairs) + " read other training pairs than rank 0 (SHA-256 of the pairs differs): " +
               "give every rank the same --dataset files (the same folder contents on every machine), " +
               "--train_size and --seed";
  }
  if (!other_tokenizer.empty()) {
    message += std::string(other_pairs.empty() ? "" : "; ") + rank_list(other_tokenizer) +
               " trained another tokenizer.model than rank 0 from the same training pairs: use the same "
               "SentencePiece library (the same build of run_data_parallel) on every machine";
  }
  throw AgreedStop(message);
}

void record_stop(const std::string& error, const dp::DistContext& world) {
  if (!world.store || world.world_size == 1) return;
  try {
    world.store->set(kStopKey + std::to_string(world.rank), std::vector<uint8_t>(error.begin(), error.end()));
  } catch (const std::exception&) {
    // The store's server (rank 0) is gone already: nobody is left to read it.
  }
}

std::string explain_stop(const std::string& error, const dp::DistContext& world) {
  if (!world.store || world.world_size == 1 || !is_peer_loss(error)) return error;
  const std::string transport = " (this rank's connection to it closed: " + error + ")";
  try {
    for (int r = 0; r < world.world_size; ++r) {
      if (r == world.rank) continue;
      const std::string key = kStopKey + std::to_string(r);
      if (!world.store->check({key})) continue;
      const std::vector<uint8_t> said = world.store->get(key);
      return "rank " + std::to_string(r) + " stopped, with: " + std::string(said.begin(), said.end()) +
             transport;
    }
  } catch (const std::exception&) {
    // The store lives in rank 0's process: it is gone when rank 0 is.
    return "rank 0 stopped: see its own message (run_data_parallel: error: ...), which says why" + transport;
  }
  return "another rank stopped without an error of its own (killed?): see the lines of the rank that ended first" +
         transport;
}

}  // namespace harness::train
