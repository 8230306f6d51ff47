// Data- and tensor-parallel process groups carved out of the world (see parallel_context.h).
#include "harness/tensor_parallel/parallel_context.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "harness/parallel/layout.h"


namespace harness::tensor_parallel {
namespace {

namespace dp = harness::data_parallel;

// One process group over `ranks` (world ranks, this rank among them) keyed by `prefix` in the
// world's store.
dp::DistContext create_group(const dp::DistContext& world, const dp::DistOptions& options,
                             const std::string& prefix, const std::vector<int>& ranks,
                             int group_rank) {
  dp::DistContext ctx;
  ctx.rank = group_rank;
  ctx.world_size = static_cast<int>(ranks.size());
  ctx.local_rank = world.local_rank;
  ctx.device = world.device;
  ctx.backend = world.backend;
  ctx.store = c10::make_intrusive<c10d::PrefixStore>(prefix, world.store);
  const std::string what_group = "process group " + prefix + " over world " + ranks_text(ranks);
  try {
    dp::DistOptions group_options = options;
    group_options.device = world.device;
    group_options.group_name = "the " + what_group;
    ctx.group = dp::create_backend(world.backend, ctx.store, ctx.rank, ctx.world_size, group_options);
  } catch (const std::exception& e) {
    const std::string text = e.what();
    throw std::runtime_error("world rank " + std::to_string(world.rank) + ": creating the " +
                             world.backend + " " + what_group + " failed: " +
                             text.substr(0, text.find('\n')));
  }
  return ctx;
}

}  // namespace

std::string ranks_text(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << "ranks [";
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << ']';
  return out.str();
}

ParallelLayout parallel_layout(int world_size, int tensor_parallel_size, int rank) {
  const parallel::Layout sizes = parallel::Layout::create(world_size, tensor_parallel_size);
  const parallel::Coordinates at = sizes.coordinates_of(rank);
  ParallelLayout layout;
  layout.world_size = world_size;
  layout.tensor_parallel_size = tensor_parallel_size;
  layout.data_parallel_size = sizes.data_parallel_size();
  layout.tensor_rank = at.tensor;
  layout.data_rank = at.data;
  layout.tensor_group_ranks = sizes.tensor_parallel_group(rank);
  layout.data_group_ranks = sizes.data_parallel_group(rank);
  return layout;
}

ParallelContext make_parallel_context(const dp::DistContext& world, const dp::DistOptions& options,
                                      int tensor_parallel_size) {
  if (!world.group) throw std::invalid_argument("make_parallel_context: the world has no process group");
  ParallelContext parallel;
  parallel.layout = parallel_layout(world.world_size, tensor_parallel_size, world.rank);
  parallel.world = world;
  const ParallelLayout& layout = parallel.layout;
  // The same order on every rank: tensor group, then data group.
  if (layout.tensor_parallel_size == world.world_size) {
    parallel.tensor = world;
  } else {
    parallel.tensor = create_group(world, options, "tp" + std::to_string(layout.data_rank),
                                   layout.tensor_group_ranks, layout.tensor_rank);
  }
  if (layout.data_parallel_size == world.world_size) {
    parallel.data = world;
  } else {
    parallel.data = create_group(world, options, "dp" + std::to_string(layout.tensor_rank),
                                 layout.data_group_ranks, layout.data_rank);
  }
  return parallel;
}

LayoutGroups make_layout_groups(const dp::DistContext& world, const dp::DistOptions& options,
                                const parallel::Layout& layout) {
  if (!world.group) throw std::invalid_argument("make_layout_groups: the world has no process group");
  if (layout.world_size() != world.world_size) {
    throw std::invalid_argument("make_layout_groups: the layout is " + layout.sizes_text() + " but the world has " +
                                std::to_string(world.world_size) + " ranks");
  }
  const parallel::Coordinates at = layout.coordinates_of(world.rank);
  const std::string p = std::to_string(at.pipeline), d = std::to_string(at.data), t = std::to_string(at.tensor);
  auto group = [&](const std::string& prefix, const std::vector<int>& ranks, int position) {
    if (static_cast<int>(ranks.size()) == world.world_size) return world;
    return create_group(world, options, prefix, ranks, position);
  };
  LayoutGroups groups;
  groups.world = world;
  groups.tensor = group("tp/p" + p + "d" + d, layout.tensor_parallel_group(world.rank), at.tensor);
  groups.data = group("dp/p" + p + "t" + t, layout.data_parallel_group(world.rank), at.data);
  groups.pipeline = group("pp/d" + d + "t" + t, layout.pipeline_group(world.rank), at.pipeline);
  const std::vector<int> embedding = layout.embedding_group(world.rank);
  if (layout.pipeline_parallel_size() > 1 && !embedding.empty()) {
    groups.embedding = group("emb/d" + d + "t" + t, embedding, at.pipeline == 0 ? 0 : 1);
  }
  return groups;
}

}  // namespace harness::tensor_parallel
