// Decisions the ranks of a run must share, agreed over the world group before training: whether
// every rank can start (one rank's refusal becomes every rank's error, with the same words), and
// whether every rank trained the same tokenizer on the same training pairs. A rank that finds a
// peer gone says which rank stopped instead of repeating the transport's error.
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/data/example.h"

namespace harness::data_parallel {
struct DistContext;
}

namespace harness::train {

// A stop every rank of the world agreed on: each throws it with the same message, so none needs
// to explain its peers' absence.
class AgreedStop : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Every rank's `mine`, in rank order (two all-gathers over `world`, issued on every rank). With no
// world, or a world of one, just {mine}.
std::vector<std::string> all_gather_strings(const std::string& mine, const data_parallel::DistContext* world);

// One rank's refusal to go on, agreed by all: every rank gathers the others' reasons (`refusal`
// empty: this rank can go on) and, if any rank refused, throws AgreedStop on every rank with the
// same message, naming each refusing rank and its reason.
void agree_to_go_on(const std::string& refusal, const data_parallel::DistContext* world);

// Hashes of what a rank's own tokenizer came from and what it is: the training pairs (SHA-256 of
// their text, in order) and the tokenizer.model file.
struct TokenizerFingerprint {
  std::string training_pairs;
  std::string tokenizer_model;
};
TokenizerFingerprint tokenizer_fingerprint(const std::vector<data::TranslationExample>& train,
                                           const std::string& tokenizer_path);

// Compares every rank's fingerprint with rank 0's (one gather, issued on every rank); where any
// differs, throws AgreedStop on every rank naming the ranks that differ, which of the
// two differs and what to make equal.
void check_ranks_share_tokenizer(const TokenizerFingerprint& mine, const data_parallel::DistContext* world);

// `error` (what this rank caught) as the message to print, for a rank whose run ended because a
// peer stopped: the transport's words ("Connection closed by peer") become "rank r stopped",
// with r's own message when r left one in the store (see record_stop), and a pointer to it.
// Other errors come back unchanged.
std::string explain_stop(const std::string& error, const data_parallel::DistContext& world);

// Leaves this rank's error in the world's store, so that a peer that finds it gone can name it
// (best effort: a store already gone is ignored).
void record_stop(const std::string& error, const data_parallel::DistContext& world);

// Leaves in the world's store which host this rank runs on (`label`: its hostname and the
// address it reaches MASTER_ADDR from), so that a rank that loses it can name its host. Best
// effort, like record_stop.
void record_host(const std::string& label, const data_parallel::DistContext& world);

// What a rank says when a collective failed for want of a peer (Gloo's "Timed out waiting ...", or
// a connection a peer closed): no rank can tell from the transport alone whether a peer died,
// stopped, timed out itself, or sits behind a cut link.
struct CollectiveDiagnosis {
  std::string message;
  bool reached_store = true;  // false: this rank cannot use the store (cut off, or its server gone)
};

// For an `error` that is such a failure, every rank that catches one says so through the store and
// waits up to `window` for each other rank to say so too or to have left a stop (record_stop).
// A rank that stopped is named with its own message, as explain_stop does; the ranks that never
// answer are named, with their hosts, as unreachable from this side; a rank that cannot reach the
// store itself within `window` says that its host (`own_host`, record_host's label) is cut off
// from `store_address` (where the store's server is gone outright, explain_stop's account).
// Other errors come back unchanged. The store is read from a thread of its own, so that a store
// behind a cut link cannot hold this rank past `window` (and a second).
CollectiveDiagnosis explain_failed_collective(const std::string& error, const data_parallel::DistContext& world,
                                              const std::string& own_host, const std::string& store_address,
                                              std::chrono::milliseconds window);

// Whether this rank reaches the world's store within `window` (a key written and read back), asked
// from a detached thread so that a store behind a cut link cannot hold the caller.
bool store_reachable(const data_parallel::DistContext& world, std::chrono::milliseconds window);

}  // namespace harness::train
