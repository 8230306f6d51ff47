// Training steps that survive a lost data-parallel replica: the recovery elastic training runs.
// Each step trains this replica's batches and its share of the dropped replicas'
// (elastic_batches.h). When the step's collective fails because a process is gone, the survivors
// agree on the next generation through the launcher's store (elastic_rendezvous.h), drop every
// replica that lost a rank (parallel/elastic.h), connect again, compose the step again over the
// new groups (compose_step.h) with the weights and AdamW state carried over in memory, and take
// the interrupted step again: the weights have not moved, since the optimizer steps only after the
// gradients' all-reduce.
//
// Layouts: any of replicas of C x T x P ranks (context, tensor and pipeline parallelism), without
// ZeRO (whose shards of the lost replica exist nowhere else). A lost rank drops its whole replica;
// that replica's other ranks leave with DeadGenerationError. With P > 1 every member passes a
// barrier of the whole generation before the optimizer steps, so that no stage steps in a step
// another stage must take again. Replacements join whole replicas: a dropped replica comes back
// once a replacement asked for each of its ranks, and each receives its state from the rank at
// its place in a surviving replica (the same stage, tensor and context rank).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <memory>
#include <vector>

#include "harness/data/collate.h"
#include "harness/data_parallel/elastic_rendezvous.h"
#include "harness/data_parallel/process_group.h"
#include "harness/parallel/elastic.h"
#include "harness/parallel/process_groups.h"
#include "harness/train/plan/plan.h"
#include "harness/train/step/build_step.h"
#include "harness/train/run/metrics_log.h"
#include "harness/train/step/train_step.h"

namespace harness::train {

struct ElasticSettings {
  // The run's plan (its world is the first generation's): its sizes other than D (context, tensor:
  // the model split over make_tensor_parallel_group's group, reconnected for each generation, and
  // pipeline stages as processes: composition.stages), and --min_replicas: fewer left, the run
  // stops (std::runtime_error naming the ranks lost). Validated by the caller (no ZeRO).
  Plan plan;
  // How long the survivors wait for each other to check in (a stopped process never does).
  std::chrono::milliseconds join_window = std::chrono::seconds(10);
  // Replacements may join (the launcher starts them, launcher.h): at the start of every step rank
  // 0 reads whether the askers complete a dropped replica, and tells the others which join (a
  // small broadcast a step).
  bool accept_joiners = false;
  // This process is a replacement (its launch id, past the world: launcher.h's
  // kElasticJoinIdVariable; -1: a process of the launch). It joins the run under way: asks, waits
  // for admission at the others' next step boundary, and receives the weights, AdamW state,
  // learning rate, step and data position from the member at its place in a surviving replica.
  // Its world (rank: the lost process's) needs a store only. Its dropout streams are its own: the
  // stages' seed (composition.stages) moves by the admitting generation times D.
  int join_id = -1;
  std::chrono::milliseconds admission_timeout = std::chrono::minutes(10);
};

// One membership change (its step counted from 1, as metrics.jsonl counts steps).
using MembershipEvent = MembershipRecord;

// What a step trained on: its rows' examples, as a count and an order-free digest (the sum of
// each example's 64-bit FNV-1a hash of de, a 0 byte and en). Summed over the members of a step,
// the same as the undisturbed run's where no data is lost or repeated.
struct ExampleDigest {
  int64_t count = 0;
  uint64_t digest = 0;
};
ExampleDigest example_digest(const std::vector<data::Batch>& batches);

// The 64-bit FNV-1a hash of `size` bytes at `data`, continuing from `hash` (the offset basis, to
// start). What the tests' digests of examples and of weights are made of.
inline constexpr uint64_t kFnv1aOffsetBasis = 1469598103934665603ull;
uint64_t fnv1a(const void* data, size_t size, uint64_t hash = kFnv1aOffsetBasis);

class ElasticTrainer {
 public:
  // Original replica r's batches of optimizer step k (its gradient-accumulation batches), the
  // same on every process.
  using BatchSource = std::function<std::vector<data::Batch>(int replica, int64_t step)>;

  // Where the run's data stands at a step's start (the epoch, and the batch in it), which a
  // replacement receives with the state; nullptr: at the start.
  struct DataPosition {
    int64_t epoch = 0;
    int64_t batch = 0;
  };
  using PositionSource = std::function<DataPosition()>;

  // `world`: this process's generation-0 world (its rank is its launch rank; its store the
  // launcher's). Throws std::invalid_argument for a layout it cannot recover.
  ElasticTrainer(model::GPT2LMHeadModel model, StepComposition composition, data_parallel::DistOptions options,
                 data_parallel::DistContext world, BatchSource batches, ElasticSettings settings = {},
                 TrainStepSettings step_settings = {}, PositionSource position = nullptr);
  ~ElasticTrainer();

  // Optimizer step `k`: its loss on this process. Admits replacements first (accept_joiners), and
  // recovers from lost processes as above; throws DeadGenerationError where this process is left
  // out, and std::runtime_error below min_replicas.
  double step(int64_t k);
  // A replacement: the step it joined at, the next it must take (0 for others), and where the
  // data stood then.
  int64_t joined_at_step() const { return joined_at_step_; }
  const DataPosition& joined_at_position() const { return joined_at_position_; }
  bool is_replacement() const { return settings_.join_id >= 0; }

  GPT2TrainStep& current() { return *step_; }
  const GPT2TrainStep& current() const { return *step_; }
  const parallel::Membership& membership() const { return membership_; }
  const std::vector<MembershipEvent>& events() const { return events_; }
  // The current generation's world: its rank and size change with the membership, its address
  // does not.
  const data_parallel::DistContext& world() const { return world_; }
  // The first generation's (its store: the launcher's, under this attempt's prefix).
  const data_parallel::DistContext& first_world() const { return first_world_; }
  int launch_rank() const { return launch_rank_; }
  int replica() const { return replica_; }
  // Throws LostProcessError naming a process of the current generation that the launcher recorded
  // as lost (a store lookup per member; for waits outside collectives).
  void check_members_alive() const;
  // Whether this process keeps the run's metrics.jsonl now: of the current members that print a
  // replica's lines (Layout::reports), the one of the lowest replica among those that started
  // with the run, or among the replacements once none of those is left. (It changes only when
  // that process is lost.)
  bool keeps_the_log() const;
  // The rows the last step() trained on this process.
  const ExampleDigest& last_examples() const { return last_examples_; }

 private:
  // This generation's step, about to take optimizer step `step` (its dropout streams count steps
  // from there, as the driver's would).
  void compose(int64_t step);
  // After a lost process at step k: agrees on the members left, drops their replicas, connects
  // again and carries what hold_and_release holds over.
  void recover(int64_t k);
  // Replacements (join_id): asks to join, waits for admission, connects, receives the state.
  void join();
  // At step k's start: admits the replacements that asked, if any (accept_joiners).
  void admit_joiners(int64_t k);
  // Rank 0's choice at a step boundary (accept_joiners): the waiting replacements that complete
  // dropped replicas, the latest asker for each rank; none when nobody new asked.
  std::vector<data_parallel::JoinRequest> choose_joiners();
  // After an admission, over each data-parallel group (the ranks at one place in every replica):
  // the first member that holds the state (not `load`) sends its weights, AdamW state, learning
  // rate, `step` and data position to the joiners (`load`), which load them. Returns the step
  // (and a joiner keeps the position).
  int64_t share_state(int64_t step, bool load);

  // What the next generation's step starts from besides the weights, which stay in the model's
  // parameters (this rank's stages' own): this rank's AdamW state and the learning rate.
  struct HeldState {
    OptimizerState optimizer;
    double learning_rate = 0.0;
  };
  // recover, from `held` (an admission that failed had let the step go already).
  void recover(int64_t k, const HeldState& held);
  // Moving to a new generation, in two halves. The first holds the state and lets the failed or
  // outgrown generation's step and groups go (their teardown takes a while, which the join
  // window absorbs, not the next group's rendezvous); the parameters another stage holds get
  // their shapes back, for the next step to cut again.
  HeldState hold_and_release();
  // The letting go alone (again where it was done: nothing more).
  void release();
  // The second connects the next generation (`order`: its members' launch ranks in its rank
  // order), composes its step for `membership` at optimizer step `step` and loads `held` into it.
  void enter(const data_parallel::Generation& next, const std::vector<int>& order,
             const parallel::Membership& membership, const HeldState& held, int64_t step);
  // The current members that stay, placed at their ranks in change.next (-1 where a new one goes).
  std::vector<int> staying_members_in_order(const parallel::MembershipChange& change) const;
  // The step's commit vote (data_parallel/elastic_rendezvous.h), once its collectives are done
  // here: returns where every member updates its weights, throws StepRetaken where none does.
  void commit_or_retake();
  // A step failed here (before this member voted): the other members take it again too.
  void call_off(int64_t k);
  // After the first step committed without them: tells the launcher (recovered_key) that the
  // processes the last recoveries left behind may be replaced.
  void announce_recovered();

  model::GPT2LMHeadModel model_;
  std::vector<std::vector<int64_t>> shapes_;  // each parameter's, whole, in the model's order
  StepComposition composition_;
  data_parallel::DistOptions options_;
  data_parallel::DistContext first_world_, world_;
  parallel::ProcessGroups groups_;
  BatchSource batches_;
  ElasticSettings settings_;
  TrainStepSettings step_settings_;
  PositionSource position_;
  DataPosition joined_at_position_;
  int launch_rank_ = 0;
  int replica_ = 0;  // this process's original replica
  parallel::Membership membership_;
  data_parallel::Generation generation_;
  std::unique_ptr<data_parallel::GradientSynchronizer> sync_;
  std::unique_ptr<GPT2TrainStep> step_;
  std::vector<MembershipEvent> events_;
  ExampleDigest last_examples_;
  // Rank 0's: the requests to join before this one are settled (admitted, or their asker lost),
  // so that a step boundary reads only the newer ones (a cache: a new rank 0 reads them all once).
  int settled_requests_ = 0;
  int64_t joined_at_step_ = 0;
  bool just_joined_ = false;
  int64_t voting_step_ = 0;  // the step that step() takes, for its commit vote
  // The processes recoveries left behind (lost, or of a dropped replica) since the last committed
  // step: every member announces them after the next one (any member may be lost before it).
  std::vector<int> left_behind_;
};

// Test hook HARNESS_TEST_KILL_AT_STEP="<launch rank>:<step>[:stop|:vote][,...]": that process
// kills itself (SIGKILL, as kill -9 would) as it starts that step (counted from 1), or with ":stop"
// stops itself there (SIGSTOP, as a hung machine would look), or with ":vote" kills itself once
// every collective of that step succeeded, before its commit vote (at_the_vote).
void kill_here_if_asked(int launch_rank, int64_t step, bool at_the_vote);

// A process of the current generation was lost outside a training step (check_members_alive).
class LostProcessError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Growing back failed after the outgrown generation was let go, other than by a lost process
// (which the members recover from, dropping the replacements again): fatal.
class AdmissionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A step's commit vote decided that every member takes the step again (a member's step failed, or
// one was lost before all voted): nothing changed, and the members agree who is left.
class StepRetaken : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Whether `error` is a collective or point-to-point failure (a peer gone or timed out), which
// elastic training recovers from, rather than an error of this process's own.
bool is_communication_failure(const std::exception& error);

}  // namespace harness::train
