// The c10d groups of a layout, carved out of the world (see process_groups.h).
#include "harness/parallel/process_groups.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <sstream>
#include <stdexcept>
#include <utility>

namespace harness::parallel {
namespace {

namespace dp = harness::data_parallel;

// One process group over `ranks` (world ranks, this rank among them) keyed by `prefix` in the
// world's store.
dp::DistContext create_group(const dp::DistContext& world, const dp::DistOptions& options, const std::string& prefix,
                             const std::vector<int>& ranks, int group_rank) {
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
    throw std::runtime_error("world rank " + std::to_string(world.rank) + ": creating the " + dp::to_string(world.backend) + " " +
                             what_group + " failed: " + text.substr(0, text.find('\n')));
  }
  return ctx;
}

// The groups made so far by their ranks, so that a dimension whose group has the same ranks as
// another's shares it instead of opening a second connection.
class GroupMaker {
 public:
  GroupMaker(const dp::DistContext& world, const dp::DistOptions& options) : world_(world), options_(options) {}

  // `shared`: whether a group made before with the same ranks may stand for this one.
  dp::DistContext operator()(const std::string& prefix, const std::vector<int>& ranks, bool shared = true) {
    if (static_cast<int>(ranks.size()) == world_.world_size) return world_;
    for (const auto& [made_ranks, made] : made_) {
      if (shared && made_ranks == ranks) return made;
    }
    int position = 0;
    while (ranks[static_cast<size_t>(position)] != world_.rank) ++position;
    made_.emplace_back(ranks, create_group(world_, options_, prefix, ranks, position));
    return made_.back().second;
  }

 private:
  const dp::DistContext& world_;
  const dp::DistOptions& options_;
  std::vector<std::pair<std::vector<int>, dp::DistContext>> made_;
};

}  // namespace

std::string ranks_text(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << "ranks [";
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << ']';
  return out.str();
}

ProcessGroups make_process_groups(const dp::DistContext& world, const dp::DistOptions& options, const Layout& layout) {
  if (!world.group) throw std::invalid_argument("make_process_groups: the world has no process group");
  if (layout.world_size() != world.world_size) {
    throw std::invalid_argument("make_process_groups: the layout is " + layout.sizes_text() + " but the world has " +
                                std::to_string(world.world_size) + " ranks");
  }
  const int rank = world.rank;
  const Coordinates at = layout.coordinates_of(rank);
  const std::string p = std::to_string(at.pipeline), d = std::to_string(at.data), c = std::to_string(at.context),
                    t = std::to_string(at.tensor);
  GroupMaker group(world, options);
  ProcessGroups groups;
  groups.world = world;
  groups.tensor = group("tp/p" + p + "d" + d + "c" + c, layout.tensor_parallel_group(rank));
  groups.context = group("cp/p" + p + "d" + d + "t" + t, layout.context_parallel_group(rank));
  groups.data = group("dp/p" + p + "c" + c + "t" + t, layout.data_parallel_group(rank));
  groups.gradient = group("grad/p" + p + "t" + t, layout.gradient_group(rank));
  groups.pipeline = group("pp/d" + d + "c" + c + "t" + t, layout.pipeline_group(rank));
  const std::vector<int> embedding = layout.embedding_group(rank);
  if (layout.pipeline_parallel_size() > 1 && !embedding.empty()) {
    // Its own connection even where it has the pipeline group's ranks (P = 2): the tied gradient's
    // all-reduce stays apart from the stages' sends and receives.
    groups.embedding = group("emb/d" + d + "c" + c + "t" + t, embedding, /*shared=*/false);
  }
  return groups;
}

}  // namespace harness::parallel
