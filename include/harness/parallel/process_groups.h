// Every c10d group of a data x context x tensor x pipeline layout that this rank belongs to,
// built from the world group in one order on every rank (parallel::Layout says which ranks each
// holds). Each group is a c10d process group over a PrefixStore of the world's store named after
// the coordinates its ranks share; every rank creates only its own groups, so no rank waits for a
// group it is not part of.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/parallel/layout.h"

namespace harness::parallel {

struct ProcessGroups {
  data_parallel::DistContext world;
  data_parallel::DistContext tensor;    // same (p, d, c): one stage of one replica's chunks, split
  data_parallel::DistContext context;   // same (p, d, t): the ranks that share each sequence
  data_parallel::DistContext data;      // same (p, c, t): the replicas
  data_parallel::DistContext gradient;  // same (p, t): data x context, what gradients are averaged
                                        // over and ZeRO shards over (the data group when C = 1)
  data_parallel::DistContext pipeline;  // same (d, c, t): the stages, ordered, point-to-point
  // The first and last stage of this rank's pipeline group, which hold wte and the tied head;
  // only on those ranks, and only when P > 1.
  std::optional<data_parallel::DistContext> embedding;
};

// Creates them in the order tensor, context, data, gradient, pipeline, embedding. A group as
// large as the world is the world; a group with the same ranks as one made before is that one
// (the gradient group is the data group when C = 1), except the embedding group, which has a
// connection of its own; a dimension of size 1 gets the rank alone.
// `options` supplies the timeout and the rendezvous host (for Gloo's interface choice). Errors
// name the group and its world ranks.
ProcessGroups make_process_groups(const data_parallel::DistContext& world, const data_parallel::DistOptions& options,
                                  const Layout& layout);

// "ranks [0, 1]"
std::string ranks_text(const std::vector<int>& ranks);

}  // namespace harness::parallel
