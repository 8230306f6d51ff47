// One step's work for a member of an elastic generation (parallel/elastic.h): the batches it
// trains, its own and its share of the dropped replicas', and what each batch's loss is divided
// by, so that the members' averaged gradient is the undisturbed run's.
//
// Undisturbed, replica r's loss is its rows' weighted sum over W_r, the label weight of its
// step's batches together (SPEC §3), and the gradients are averaged over the D replicas. In a
// generation of D' members, a batch of replica r (or a share of its rows) is divided by
// W_r x D / D': averaged over the D' members, every replica's rows then count as they did.
#pragma once

#include <vector>

#include "harness/data/collate.h"
#include "harness/parallel/elastic.h"

namespace harness::train {

struct ElasticStepBatches {
  std::vector<data::Batch> batches;
  std::vector<double> loss_divisors;  // for GPT2TrainStep::step(batches, loss_divisors)
};

// `replica_batches[r]`: original replica r's batches of this step (its gradient-accumulation
// batches, in order; those of replicas `slices` does not name may be left empty). `slices`: this
// member's rows (its entry of rows_per_member), counted over the concatenation of a replica's step
// batches; a slice that spans two batches gives a piece of each. The pieces keep their examples.
// Throws std::invalid_argument naming the replica for a slice beyond its rows, or a replica whose
// label weights sum to 0.
ElasticStepBatches elastic_step_batches(const parallel::Membership& membership,
                                        const std::vector<parallel::RowSlice>& slices,
                                        const std::vector<std::vector<data::Batch>>& replica_batches);

}  // namespace harness::train
