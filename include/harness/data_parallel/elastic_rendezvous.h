// How the processes that survive a lost one agree on who is left, and connect again: through the
// rendezvous store the launcher serves (launcher.h: LaunchOptions::serve_store and elastic), which
// no worker's death takes with it. A process is named by its launch rank (RANK at start), which
// never changes; a generation's ranks are positions in its member list.
//
// Keys, in the workers' store:
//   elastic/lost/<launch rank>             the launcher: that process died (the reason)
//   elastic/gen<g>/alive/<launch rank>     a process checked in to form generation g
//   elastic/gen<g>/decider                 a counter: the process that adds the first 1 decides
//   elastic/gen<g>/members                 the decision: generation g's launch ranks, in rank order
//   elastic/gen<g>/group/...               the rendezvous of generation g's process group
//   elastic/recovered/<launch rank>        the survivors committed a step without that process:
//                                          the launcher may start its replacement (the survivors'
//                                          recovery has not shared the machine with its start)
//   elastic/heartbeat/<launch rank>        a counter each process adds to every kHeartbeatPeriod
//                                          when no launcher of ours watches it (torchrun across
//                                          hosts): one that stands still for kHeartbeatStaleAfter
//                                          is lost, whole hosts included, with nobody to record it
//
// The decider waits until every member of the generation before has checked in or is known lost,
// or until the join window ends (a process stopped by SIGSTOP neither checks in nor dies), and
// writes the members; everyone reads that one decision. A process left out of it (one that checked
// in too late, or comes back from SIGSTOP after the others moved on) belongs to a dead generation
// and gets DeadGenerationError: it must exit, not train.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness/data_parallel/process_group.h"

namespace harness::data_parallel {

struct Generation {
  int number = 0;
  std::vector<int> members;  // launch ranks, in rank order
  // Where an admission recorded it (admit): each member's original data-parallel replica, in
  // member order, for a process that joins and knows only its own.
  std::vector<int> replicas;
  // Where an admission recorded it: the members it admitted (launch ids), in rank order.
  std::vector<int> joined;
  // This process's rank in the generation (its position in members), or -1.
  int rank_of(int launch_rank) const;
};

class DeadGenerationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The key the launcher sets when the process of `launch_rank` dies (its value: the reason).
std::string lost_process_key(int launch_rank);
// The key the survivors set once they committed a step without the process of `launch_rank`
// (its value: the generation that did), which the launcher waits for to start its replacement.
std::string recovered_key(int launch_rank);

// Heartbeats: where no launcher of ours records lost processes (torchrun's agents watch only the
// processes of their own host, and a lost host takes its agent with it), each process beats, and
// the others read a beat that stands still as a loss.
inline constexpr std::chrono::milliseconds kHeartbeatPeriod{200};
inline constexpr std::chrono::milliseconds kHeartbeatStaleAfter{2500};
std::string heartbeat_key(int launch_rank);

// Adds to this process's heartbeat every `period` from a thread of its own, over a store client of
// its own (a long wait on the process's other client must not stop the beat). Stops, and joins the
// thread, when destroyed. A store that fails ends the beat: the others then read this process lost.
class Heartbeat {
 public:
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int launch_rank,
            std::chrono::milliseconds period = kHeartbeatPeriod);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  void beat();
  c10::intrusive_ptr<c10d::Store> store_;
  const std::string key_;
  const std::chrono::milliseconds period_;
  std::mutex mutex_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

// Whether a member is lost: recorded so by the launcher, or (where it beats) its heartbeat stood
// still for `stale_after`. Remembers each member's last count and when it changed, so it is asked
// again and again by one waiter; a member that never beat is judged by the launcher's record alone.
class LossWatch {
 public:
  explicit LossWatch(std::chrono::milliseconds stale_after = kHeartbeatStaleAfter) : stale_after_(stale_after) {}
  bool lost(c10d::Store& store, int member);

 private:
  struct Seen {
    int64_t count = 0;
    std::chrono::steady_clock::time_point since;
  };
  std::chrono::milliseconds stale_after_;
  std::map<int, Seen> seen_;
};

// Called by every process of generation `now` that is still alive, after a collective failed:
// generation now.number + 1, the members of `now` that checked in, in their order in `now`. Throws
// DeadGenerationError when the decision leaves this process out, and std::runtime_error when no
// decision arrives within join_window and 30 s more (its decider died while deciding).
Generation agree_next_generation(c10d::Store& store, const Generation& now, int launch_rank,
                                 std::chrono::milliseconds join_window);

// A step's commit (PyTorch torchft's should_commit, through this store): a step changes the
// weights on every member of its generation or on none, even when a member is lost in the middle
// of a collective that some members completed and others did not. A member whose collectives of
// step `step` all succeeded votes before its optimizer changes anything. Keys:
//   elastic/gen<g>/step<k>/votes     a counter: the members that voted
//   elastic/gen<g>/step<k>/decision  "commit" or "retake": the first one set stands (compareSet)
// The member whose vote completes the count decides commit. A member whose step failed decides
// retake (call_off_step), and so does a voter that finds a member recorded lost (by the launcher)
// while the decision is still open. Every member follows the one decision: a member lost after
// voting leaves a step that every survivor commits, or that every survivor takes again.
enum class StepDecision { kCommit, kRetake };
StepDecision vote_to_commit(c10d::Store& store, const Generation& now, int64_t step, int launch_rank,
                            std::chrono::milliseconds timeout);
// Decides retake unless a decision stands; std::logic_error where that one is commit (a member
// that did not vote cannot have let it commit).
void call_off_step(c10d::Store& store, const Generation& now, int64_t step, int launch_rank);

// Joining (a replacement the launcher started for a lost process, launcher.h): the process asks
// to join under its launch id; rank 0 of the current generation, at a step boundary, reads who
// asked (and must tell the others: they may read the store at other times) and writes the next
// generation with them; the asker waits for that generation. Keys:
//   elastic/joins                          a counter: the askers so far
//   elastic/join/<n>                       the n-th asker's launch id and the launch rank it
//                                          takes (the lost process's RANK), from 1
//   elastic/admitted/<launch id>           the generation that admitted it
//   elastic/closed                         the launcher: no member is left to admit anyone (the
//                                          run ended); the askers still waiting leave
struct JoinRequest {
  int launch_id = 0;
  int rank = 0;    // the rank it takes: a lost process's launch rank
  int number = 0;  // its place among the requests, from 1 (joins_after sets it)
  bool operator==(const JoinRequest& o) const {
    return launch_id == o.launch_id && rank == o.rank && number == o.number;
  }
};
// Returns its place among the askers (from 1).
int ask_to_join(c10d::Store& store, const JoinRequest& request);
// How many asked so far (one store call).
int join_count(c10d::Store& store);
// The requests after the first `skipped`, in the order they were made. A request counted but not
// written yet is left out (its asker is between the two; or died there, leaving a gap for good).
std::vector<JoinRequest> joins_after(c10d::Store& store, int skipped);
// Writes generation now.number + 1 with `members` (launch ranks in its rank order: now's members
// and the admitted) and their original `replicas` (in member order), then tells each new member;
// returns it. Throws std::invalid_argument for members that repeat or replicas of another count.
Generation admit(c10d::Store& store, const Generation& now, const std::vector<int>& members,
                 const std::vector<int>& replicas);
// The asker's wait for the generation that admits it; RunEndedError once admissions are closed,
// std::runtime_error after `timeout`.
Generation await_admission(c10d::Store& store, int launch_id, std::chrono::milliseconds timeout);
// The keys above, for the launcher: whether launch id `launch_id` was admitted, and the closing.
std::string admitted_key(int launch_id);
std::string admissions_closed_key();
// The run ended before a waiting replacement was admitted: it has nothing to do.
class RunEndedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The process group of the processes `members` (launch ranks, in the new rank order, a subset of
// `generation`'s members that includes this process) under `generation`'s keys: `world` (the
// first generation's) with its rank, size and group replaced, and its store prefixed by the
// generation and the members, so that groups built from it (process_groups.h) are new ones too.
// `options` gives the backend's transport and timeout.
DistContext connect_generation(const DistContext& world, const Generation& generation,
                               const std::vector<int>& members, int launch_rank, const DistOptions& options);

}  // namespace harness::data_parallel
