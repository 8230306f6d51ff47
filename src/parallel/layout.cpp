// The data x context x tensor x pipeline layout of a run (see layout.h).
#include "harness/parallel/layout.h"

#include <iomanip>
#include <sstream>
#include <stdexcept>

namespace harness::parallel {
namespace {

void check_at_least_one(const char* flag, int value) {
  if (value < 1) throw std::invalid_argument(std::string(flag) + " " + std::to_string(value) + " must be at least 1");
}

}  // namespace

Layout Layout::create(int world_size, const LayoutSizes& sizes) {
  check_at_least_one("--world_size", world_size);
  check_at_least_one("--tensor_parallel_size", sizes.tensor);
  check_at_least_one("--context_parallel_size", sizes.context);
  check_at_least_one("--pipeline_parallel_size", sizes.pipeline);
  const int model_ranks = sizes.context * sizes.tensor * sizes.pipeline;
  if (world_size % model_ranks != 0) {
    // The tensor size always, the context and pipeline sizes where asked for: a data x tensor or
    // a 3D run is refused in the words it was before.
    std::string product = "--tensor_parallel_size " + std::to_string(sizes.tensor);
    std::string meaning = "data-parallel x tensor-parallel";
    if (sizes.context > 1) {
      product = "--context_parallel_size " + std::to_string(sizes.context) + " x " + product;
      meaning = "data-parallel x context-parallel x tensor-parallel";
    }
    if (sizes.pipeline > 1) {
      product += " x --pipeline_parallel_size " + std::to_string(sizes.pipeline);
      meaning += " x pipeline-parallel";
    }
    const bool tensor_alone = sizes.context == 1 && sizes.pipeline == 1;
    throw std::invalid_argument("--world_size " + std::to_string(world_size) + " is not divisible by " + product +
                                (tensor_alone ? " (world size = data-parallel size x tensor-parallel size)"
                                              : " = " + std::to_string(model_ranks) + " (world size = " + meaning +
                                                    " size)"));
  }
  if (sizes.sequence_parallel && sizes.tensor < 2) {
    throw std::invalid_argument("--sequence_parallel splits the sequence over the tensor-parallel group: it needs "
                                "--tensor_parallel_size 2 or more, not " + std::to_string(sizes.tensor));
  }
  return Layout(world_size / model_ranks, sizes);
}

void Layout::check_rank(int rank) const {
  if (rank < 0 || rank >= world_size()) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is outside [0, world size " +
                                std::to_string(world_size()) + ")");
  }
}

int Layout::rank_of(const Coordinates& c) const {
  auto inside = [](int value, int size) { return value >= 0 && value < size; };
  if (!inside(c.data, data_) || !inside(c.context, context_) || !inside(c.tensor, tensor_) ||
      !inside(c.pipeline, pipeline_)) {
    throw std::invalid_argument("coordinates (d " + std::to_string(c.data) + ", c " + std::to_string(c.context) +
                                ", t " + std::to_string(c.tensor) + ", p " + std::to_string(c.pipeline) +
                                ") are outside " + sizes_text());
  }
  return ((c.pipeline * data_ + c.data) * context_ + c.context) * tensor_ + c.tensor;
}

Coordinates Layout::coordinates_of(int rank) const {
  check_rank(rank);
  Coordinates c;
  c.tensor = rank % tensor_;
  c.context = (rank / tensor_) % context_;
  c.data = (rank / (tensor_ * context_)) % data_;
  c.pipeline = rank / (tensor_ * context_ * data_);
  return c;
}

std::vector<int> Layout::group_along(int rank, int Coordinates::*axis, int size) const {
  Coordinates c = coordinates_of(rank);
  std::vector<int> ranks;
  for (c.*axis = 0; c.*axis < size; ++(c.*axis)) ranks.push_back(rank_of(c));
  return ranks;
}

std::vector<int> Layout::data_parallel_group(int rank) const { return group_along(rank, &Coordinates::data, data_); }

std::vector<int> Layout::context_parallel_group(int rank) const {
  return group_along(rank, &Coordinates::context, context_);
}

std::vector<int> Layout::gradient_group(int rank) const {
  // Same (p, t): the D * C ranks from (d, c) = (0, 0), ordered by d * C + c, which is rank order.
  Coordinates c = coordinates_of(rank);
  std::vector<int> ranks;
  for (c.data = 0; c.data < data_; ++c.data) {
    for (c.context = 0; c.context < context_; ++c.context) ranks.push_back(rank_of(c));
  }
  return ranks;
}

std::vector<int> Layout::tensor_parallel_group(int rank) const {
  return group_along(rank, &Coordinates::tensor, tensor_);
}

std::vector<int> Layout::pipeline_group(int rank) const {
  return group_along(rank, &Coordinates::pipeline, pipeline_);
}

std::vector<int> Layout::embedding_group(int rank) const {
  if (!is_first_stage(rank) && !is_last_stage(rank)) return {};
  const std::vector<int> stages = pipeline_group(rank);
  if (stages.size() == 1 || loss_on_first_stage_) return {stages.front()};
  return {stages.front(), stages.back()};
}

namespace {

// Each rank's group of one kind, kept the first time a group's lowest rank is met.
template <typename GroupOf>
std::vector<std::vector<int>> every_group(int world_size, GroupOf group_of) {
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < world_size; ++r) {
    std::vector<int> group = group_of(r);
    if (!group.empty() && group.front() == r) groups.push_back(std::move(group));
  }
  return groups;
}

}  // namespace

std::vector<std::vector<int>> Layout::data_parallel_groups() const {
  return every_group(world_size(), [this](int r) { return data_parallel_group(r); });
}

std::vector<std::vector<int>> Layout::context_parallel_groups() const {
  return every_group(world_size(), [this](int r) { return context_parallel_group(r); });
}

std::vector<std::vector<int>> Layout::gradient_groups() const {
  return every_group(world_size(), [this](int r) { return gradient_group(r); });
}

std::vector<std::vector<int>> Layout::tensor_parallel_groups() const {
  return every_group(world_size(), [this](int r) { return tensor_parallel_group(r); });
}

std::vector<std::vector<int>> Layout::pipeline_groups() const {
  return every_group(world_size(), [this](int r) { return pipeline_group(r); });
}

std::vector<std::vector<int>> Layout::embedding_groups() const {
  return every_group(world_size(), [this](int r) { return embedding_group(r); });
}

bool Layout::reports(int rank) const {
  const Coordinates c = coordinates_of(rank);
  return c.pipeline == loss_stage_rank() && c.context == 0 && c.tensor == 0;
}

std::string Layout::sizes_text() const {
  return "data " + std::to_string(data_) + (context_ > 1 ? " x context " + std::to_string(context_) : "") + " x tensor " + std::to_string(tensor_) + " x pipeline " +
         std::to_string(pipeline_) + " = world " + std::to_string(world_size());
}

std::string Layout::coordinates_table(const std::string& note) const {
  std::ostringstream out;
  // The context column only where sequences are split, so a 3D run's table reads as before.
  const bool context = context_ > 1;
  out << "layout: " << sizes_text() << (context ? ", rank = ((p*D + d)*C + c)*T + t" : ", rank = (p*D + d)*T + t")
      << note << "\n";
  out << "  rank  data" << (context ? "  context" : "") << "  tensor  pipeline  reports\n";
  for (int r = 0; r < world_size(); ++r) {
    const Coordinates c = coordinates_of(r);
    out << std::setw(6) << r << std::setw(6) << c.data;
    if (context) out << std::setw(9) << c.context;
    out << std::setw(8) << c.tensor << std::setw(10) << c.pipeline << "  "
        << (reports(r) ? "Rank " + std::to_string(c.data) : std::string("-")) << "\n";
  }
  return out.str();
}

}  // namespace harness::parallel
