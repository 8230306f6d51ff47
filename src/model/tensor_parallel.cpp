// The shard arithmetic of tensor parallelism (see tensor_parallel.h).
#include "harness/model/tensor_parallel.h"

#include <torch/torch.h>

#include <sstream>
#include <stdexcept>

#include "harness/model/config.h"
#include "shape_text.h"

namespace harness::model {
namespace {

int64_t parts_of(const ShardSpec& spec) { return spec.kind == ShardSpec::Kind::kColumns ? spec.fused_parts : 1; }

}  // namespace

int64_t ShardSpec::split_dim(int64_t dims) const {
  switch (kind) {
    case Kind::kColumns: return dims - 1;
    case Kind::kRows: return 0;
    case Kind::kReplicated: break;
  }
  return -1;
}

std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t extent, const ShardSpec& spec, int rank,
                                                      int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("shard: rank " + std::to_string(rank) + " outside [0, " +
                                std::to_string(world_size) + ")");
  }
  if (spec.kind == ShardSpec::Kind::kReplicated) return {{0, extent}};
  const int64_t parts = parts_of(spec);
  if (parts < 1 || extent % (parts * world_size) != 0) {
    throw std::invalid_argument("shard: extent " + std::to_string(extent) + " is not divisible into " +
                                std::to_string(parts) + " fused part(s) x " + std::to_string(world_size) +
                                " ranks");
  }
  const int64_t block = extent / parts, width = block / world_size;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t p = 0; p < parts; ++p) ranges.emplace_back(p * block + rank * width, width);
  return ranges;
}

at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int rank, int world_size) {
  if (spec.kind != ShardSpec::Kind::kReplicated && full.dim() == 0) {
    throw std::invalid_argument("shard_tensor: a scalar cannot be split");
  }
  const int64_t dim = spec.split_dim(full.dim());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  try {
    ranges = shard_ranges(dim < 0 ? 0 : full.size(dim), spec, rank, world_size);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("shard_tensor: dimension " + std::to_string(dim) + " of shape " +
                                shape_str(full.sizes()) + ": " + e.what());
  }
  if (spec.kind == ShardSpec::Kind::kReplicated) return full;
  std::vector<at::Tensor> pieces;
  for (const auto& [start, length] : ranges) pieces.push_back(full.narrow(dim, start, length));
  return pieces.size() == 1 ? pieces[0] : torch::cat(pieces, dim);
}

at::Tensor unshard_tensor(const std::vector<at::Tensor>& shards, const ShardSpec& spec) {
  if (shards.empty()) throw std::invalid_argument("unshard_tensor: no shards");
  if (spec.kind == ShardSpec::Kind::kReplicated) return shards.front();
  for (const auto& s : shards) {
    if (s.sizes() != shards.front().sizes()) {
      throw std::invalid_argument("unshard_tensor: shards of different shapes " +
                                  shape_str(shards.front().sizes()) + " and " + shape_str(s.sizes()));
    }
  }
  const int64_t dim = spec.split_dim(shards.front().dim());
  const int64_t parts = parts_of(spec);
  const int64_t local = shards.front().size(dim);
  if (parts < 1 || local % parts != 0) {
    throw std::invalid_argument("unshard_tensor: shard dimension " + std::to_string(local) +
                                " is not divisible into " + std::to_string(parts) + " fused parts");
  }
  const int64_t width = local / parts;
  std::vector<at::Tensor> pieces;
  for (int64_t p = 0; p < parts; ++p) {
    for (const auto& s : shards) pieces.push_back(s.narrow(dim, p * width, width));
  }
  return torch::cat(pieces, dim);
}

void validate_tensor_parallel(const GPT2Config& config, int tensor_parallel_size) {
  config.validate();
  if (tensor_parallel_size < 1) {
    throw std::invalid_argument("--tensor_parallel_size " + std::to_string(tensor_parallel_size) +
                                " must be at least 1");
  }
  if (config.n_head % tensor_parallel_size != 0) {
    throw std::invalid_argument("tensor parallelism splits the attention heads: n_head " +
                                std::to_string(config.n_head) + " is not divisible by --tensor_parallel_size " +
                                std::to_string(tensor_parallel_size));
  }
  if (config.inner_dim() % tensor_parallel_size != 0) {
    throw std::invalid_argument("tensor parallelism splits the MLP: inner size " +
                                std::to_string(config.inner_dim()) + " is not divisible by --tensor_parallel_size " +
                                std::to_string(tensor_parallel_size));
  }
}

}  // namespace harness::model
