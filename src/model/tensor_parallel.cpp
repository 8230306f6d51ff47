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
    case Kind::kRows:
    case Kind::kBalancedRows: return 0;
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
  if (spec.kind == ShardSpec::Kind::kBalancedRows) {
    const VocabularyRange range = vocabulary_range(extent, rank, world_size);
    return {{range.start, range.size()}};
  }
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
  if (spec.kind == ShardSpec::Kind::kBalancedRows) {
    const int world = static_cast<int>(shards.size());
    int64_t rows = 0;
    for (const auto& s : shards) rows += s.dim() > 0 ? s.size(0) : 0;
    for (int r = 0; r < world; ++r) {
      const at::Tensor& s = shards[static_cast<size_t>(r)];
      const bool same_rest = s.dim() > 0 && s.dim() == shards.front().dim() &&
                             s.sizes().slice(1) == shards.front().sizes().slice(1);
      if (!same_rest || rows < world || s.size(0) != vocabulary_range(rows, r, world).size()) {
        throw std::invalid_argument("unshard_tensor: shard " + shape_str(s.sizes()) + " of rank " + std::to_string(r) +
                                    " (rank 0's " + shape_str(shards.front().sizes()) +
                                    ") is not its part of a balanced split of " + std::to_string(rows) +
                                    " rows over " + std::to_string(world) + " ranks");
      }
    }
    return torch::cat(shards, 0);
  }
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

VocabularyRange vocabulary_range(int64_t vocab_size, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("vocabulary_range: rank " + std::to_string(rank) + " outside [0, " +
                                std::to_string(world_size) + ")");
  }
  if (vocab_size < world_size) {
    throw std::invalid_argument("vocabulary_range: " + std::to_string(vocab_size) + " ids cannot be split over " +
                                std::to_string(world_size) + " ranks");
  }
  const int64_t base = vocab_size / world_size, extra = vocab_size % world_size;
  const int64_t start = rank * base + std::min<int64_t>(rank, extra);
  return {start, start + base + (rank < extra ? 1 : 0)};
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
  if (config.vocab_size < tensor_parallel_size) {
    throw std::invalid_argument("tensor parallelism splits the tied head over the vocabulary: vocab_size " +
                                std::to_string(config.vocab_size) + " is smaller than --tensor_parallel_size " +
                                std::to_string(tensor_parallel_size));
  }
}

}  // namespace harness::model
