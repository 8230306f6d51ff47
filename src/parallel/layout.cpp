// The data x tensor x pipeline layout of a run (see layout.h).
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

Layout Layout::create(int world_size, int tensor_parallel_size, int pipeline_parallel_size, int zero_stage) {
  check_at_least_one("--world_size", world_size);
  check_at_least_one("--tensor_parallel_size", tensor_parallel_size);
  check_at_least_one("--pipeline_parallel_size", pipeline_parallel_size);
  const int model_ranks = tensor_parallel_size * pipeline_parallel_size;
  if (world_size % model_ranks != 0) {
    if (pipeline_parallel_size == 1) {
      throw std::invalid_argument("--world_size " + std::to_string(world_size) +
                                  " is not divisible by --tensor_parallel_size " +
                                  std::to_string(tensor_parallel_size) +
                                  " (world size = data-parallel size x tensor-parallel size)");
    }
    throw std::invalid_argument("--world_size " + std::to_string(world_size) + " is not divisible by " +
                                "--tensor_parallel_size " + std::to_string(tensor_parallel_size) +
                                " x --pipeline_parallel_size " + std::to_string(pipeline_parallel_size) + " = " +
                                std::to_string(model_ranks) +
                                " (world size = data-parallel x tensor-parallel x pipeline-parallel size)");
  }
  if (zero_stage < 0 || zero_stage > 3) {
    throw std::invalid_argument("--zero_stage " + std::to_string(zero_stage) + ": expected 0, 1, 2 or 3");
  }
  if (zero_stage == 3 && pipeline_parallel_size > 1) {
    throw std::invalid_argument("--zero_stage 3 gathers every unit (GPT-2's blocks) in every step's forward and backward "
                                "on each data-parallel rank: it does not combine with --pipeline_parallel_size " +
                                std::to_string(pipeline_parallel_size) +
                                " (each stage's units would have to be gathered within its stage's schedule; use "
                                "--zero_stage 1 or 2 there)");
  }
  return Layout(world_size / model_ranks, tensor_parallel_size, pipeline_parallel_size, zero_stage);
}

void Layout::check_rank(int rank) const {
  if (rank < 0 || rank >= world_size()) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is outside [0, world size " +
                                std::to_string(world_size()) + ")");
  }
}

int Layout::rank_of(const Coordinates& c) const {
  if (c.data < 0 || c.data >= data_ || c.tensor < 0 || c.tensor >= tensor_ || c.pipeline < 0 ||
      c.pipeline >= pipeline_) {
    throw std::invalid_argument("coordinates (d " + std::to_string(c.data) + ", t " + std::to_string(c.tensor) +
                                ", p " + std::to_string(c.pipeline) + ") are outside " + sizes_text());
  }
  return (c.pipeline * data_ + c.data) * tensor_ + c.tensor;
}

Coordinates Layout::coordinates_of(int rank) const {
  check_rank(rank);
  Coordinates c;
  c.tensor = rank % tensor_;
  c.data = (rank / tensor_) % data_;
  c.pipeline = rank / (tensor_ * data_);
  return c;
}

std::vector<int> Layout::group_along(int rank, int Coordinates::*axis, int size) const {
  Coordinates c = coordinates_of(rank);
  std::vector<int> ranks;
  for (c.*axis = 0; c.*axis < size; ++(c.*axis)) ranks.push_back(rank_of(c));
  return ranks;
}

std::vector<int> Layout::data_parallel_group(int rank) const { return group_along(rank, &Coordinates::data, data_); }

std::vector<int> Layout::tensor_parallel_group(int rank) const {
  return group_along(rank, &Coordinates::tensor, tensor_);
}

std::vector<int> Layout::pipeline_group(int rank) const {
  return group_along(rank, &Coordinates::pipeline, pipeline_);
}

std::vector<int> Layout::embedding_group(int rank) const {
  if (!is_first_stage(rank) && !is_last_stage(rank)) return {};
  const std::vector<int> stages = pipeline_group(rank);
  if (stages.size() == 1) return stages;
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
  return c.pipeline == pipeline_ - 1 && c.tensor == 0;
}

std::string Layout::sizes_text() const {
  return "data " + std::to_string(data_) + " x tensor " + std::to_string(tensor_) + " x pipeline " +
         std::to_string(pipeline_) + " = world " + std::to_string(world_size());
}

std::string Layout::coordinates_table() const {
  std::ostringstream out;
  out << "layout: " << sizes_text() << ", rank = (p*D + d)*T + t"
      << (zero_stage_ ? ", ZeRO stage " + std::to_string(zero_stage_) : std::string()) << "\n";
  out << "  rank  data  tensor  pipeline  reports\n";
  for (int r = 0; r < world_size(); ++r) {
    const Coordinates c = coordinates_of(r);
    out << std::setw(6) << r << std::setw(6) << c.data << std::setw(8) << c.tensor << std::setw(10) << c.pipeline
        << "  " << (reports(r) ? "Rank " + std::to_string(c.data) : std::string("-")) << "\n";
  }
  return out.str();
}

}  // namespace harness::parallel
