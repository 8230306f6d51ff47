// Process groups for data x tensor parallelism, built explicitly from the world group in the rank
// order of parallel::Layout (harness/parallel/layout.h): with T = tensor_parallel_size, the
// tensor-parallel group of rank r is {d*T, ..., d*T + T-1} (d = r / T) and its data-parallel group
// is {t, t + T, t + 2T, ...} (t = r % T). Neighbouring ranks share a tensor-parallel group because
// it communicates in every layer (Megatron's order).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/parallel/layout.h"

namespace harness::tensor_parallel {

// The rank layout alone (pure): which world ranks form this rank's groups.
struct ParallelLayout {
  int world_size = 1;
  int tensor_parallel_size = 1;
  int data_parallel_size = 1;
  int tensor_rank = 0;  // r % T: position inside the tensor-parallel group
  int data_rank = 0;    // r / T: position inside the data-parallel group
  std::vector<int> tensor_group_ranks;  // world ranks of this rank's tensor-parallel group
  std::vector<int> data_group_ranks;    // world ranks of this rank's data-parallel group
};

// This rank's part of parallel::Layout::create(world_size, tensor_parallel_size): throws
// std::invalid_argument naming --world_size and --tensor_parallel_size with their values when
// T < 1 or T does not divide the world size, and the rank when it is outside the world.
ParallelLayout parallel_layout(int world_size, int tensor_parallel_size, int rank);

struct ParallelContext {
  ParallelLayout layout;
  data_parallel::DistContext world;   // every rank
  data_parallel::DistContext data;    // the ranks holding the same shard of the model
  data_parallel::DistContext tensor;  // the ranks that together hold one replica of the model
};

// Builds the tensor- and data-parallel groups of `world` (same backend and device), each a
// c10d process group over a PrefixStore ("tp<d>", "dp<t>") of the world's store: every rank
// creates only its own two groups, tensor group first, so no rank waits for a group it is not
// part of. A dimension that spans the whole world reuses the world group. `options` supplies the
// timeout and the rendezvous host (for Gloo's interface choice) used for the world.
// Errors name the group and the ranks involved.
ParallelContext make_parallel_context(const data_parallel::DistContext& world,
                                      const data_parallel::DistOptions& options,
                                      int tensor_parallel_size);

// "ranks [0, 1]"
// Every c10d group of a data x tensor x pipeline layout that this rank belongs to (parallel::Layout
// says which ranks each holds), created in one order on every rank: tensor, data, pipeline,
// embedding. A dimension of size 1 gets the rank alone; one as large as the world, the world.
struct LayoutGroups {
  data_parallel::DistContext world;
  data_parallel::DistContext tensor;    // same (p, d): one stage of one replica, split
  data_parallel::DistContext data;      // same (p, t): what gradients are averaged over
  data_parallel::DistContext pipeline;  // same (d, t): the stages, ordered, point-to-point
  // The first and last stage of this rank's pipeline group, which hold wte and the tied head;
  // only on those ranks, and only when P > 1.
  std::optional<data_parallel::DistContext> embedding;
};

LayoutGroups make_layout_groups(const data_parallel::DistContext& world, const data_parallel::DistOptions& options,
                                const parallel::Layout& layout);

std::string ranks_text(const std::vector<int>& ranks);

}  // namespace harness::tensor_parallel
