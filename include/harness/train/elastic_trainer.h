// Training steps that survive a lost data-parallel replica: the recovery elastic training runs.
// Each step trains this replica's batches and its share of the dropped replicas'
// (elastic_batches.h). When the step's collective fails because a process is gone, the survivors
// agree on the next generation through the launcher's store (elastic_rendezvous.h), drop every
// replica that lost a rank (parallel/elastic.h), connect again, compose the step again over the
// new groups (compose_step.h) with the weights and AdamW state carried over in memory, and take
// the interrupted step again: the weights have not moved, since the optimizer steps only after the
// gradients' all-reduce.
//
// Layouts: replicas of the whole model (C = T = P = 1), without ZeRO (whose shards of the lost
// replica exist nowhere else); others are refused.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "harness/data/collate.h"
#include "harness/data_parallel/elastic_rendezvous.h"
#include "harness/data_parallel/process_group.h"
#include "harness/parallel/elastic.h"
#include "harness/parallel/process_groups.h"
#include "harness/train/compose_step.h"
#include "harness/train/train_step.h"

namespace harness::train {

struct ElasticSettings {
  int min_replicas = 1;  // fewer left: the run stops (std::runtime_error naming the ranks lost)
  // How long the survivors wait for each other to check in (a stopped process never does).
  std::chrono::milliseconds join_window = std::chrono::seconds(10);
};

// One membership change: the generation it formed, the step it happened in, the replicas left,
// and the processes (launch ranks) lost.
struct MembershipEvent {
  int generation = 0;
  int64_t step = 0;
  int replicas = 0;
  std::vector<int> lost;
};

class ElasticTrainer {
 public:
  // Original replica r's batches of optimizer step k (its gradient-accumulation batches), the
  // same on every process.
  using BatchSource = std::function<std::vector<data::Batch>(int replica, int64_t step)>;

  // `world`: this process's generation-0 world (its rank is its launch rank; its store the
  // launcher's). Throws std::invalid_argument for a layout it cannot recover.
  ElasticTrainer(model::GPT2LMHeadModel model, StepComposition composition, data_parallel::DistOptions options,
                 data_parallel::DistContext world, BatchSource batches, ElasticSettings settings = {});
  ~ElasticTrainer();

  // Optimizer step `k`: its loss on this process. Recovers from lost processes as above; throws
  // DeadGenerationError where this process is left out, and std::runtime_error below
  // min_replicas.
  double step(int64_t k);

  GPT2TrainStep& current() { return *step_; }
  const parallel::Membership& membership() const { return membership_; }
  const std::vector<MembershipEvent>& events() const { return events_; }
  const data_parallel::DistContext& world() const { return world_; }

 private:
  void compose();
  void recover(int64_t k);

  model::GPT2LMHeadModel model_;
  StepComposition composition_;
  data_parallel::DistOptions options_;
  data_parallel::DistContext first_world_, world_;
  parallel::ProcessGroups groups_;
  BatchSource batches_;
  ElasticSettings settings_;
  int launch_rank_ = 0;
  int replica_ = 0;  // this process's original replica
  parallel::Membership membership_;
  data_parallel::Generation generation_;
  std::unique_ptr<data_parallel::GradientSynchronizer> sync_;
  std::unique_ptr<GPT2TrainStep> step_;
  std::vector<MembershipEvent> events_;
};

// Whether `error` is a collective or point-to-point failure (a peer gone or timed out), which
// elastic training recovers from, rather than an error of this process's own.
bool is_communication_failure(const std::exception& error);

}  // namespace harness::train
