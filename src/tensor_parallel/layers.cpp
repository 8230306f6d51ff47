// Column- and row-parallel linear layers and the shard arithmetic behind them (see layers.h).
#include "harness/tensor_parallel/layers.h"

#include <torch/torch.h>

#include <sstream>
#include <stdexcept>

#include "harness/tensor_parallel/comm_ops.h"

namespace harness::tensor_parallel {
namespace {

namespace dp = harness::data_parallel;

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << ']';
  return out.str();
}

int group_size(const dp::DistContext& tp, const char* layer) {
  if (!tp.group) throw std::invalid_argument(std::string(layer) + ": no tensor-parallel process group");
  return tp.world_size;
}

void require_divisible(const char* layer, const char* what, int64_t value, int64_t by,
                       const std::string& by_text) {
  if (value <= 0 || value % by != 0) {
    throw std::invalid_argument(std::string(layer) + ": " + what + " " + std::to_string(value) +
                                " is not a positive multiple of " + by_text + " = " +
                                std::to_string(by));
  }
}

// y = x @ weight (+ bias) over the last dimension, as Hugging Face's Conv1D computes it.
at::Tensor conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = weight.size(1);
  const auto x2 = x.reshape({-1, x.size(-1)});
  auto y = bias.defined() ? torch::addmm(bias, x2, weight) : torch::mm(x2, weight);
  return y.view(out_sizes);
}

void copy_checked(at::Tensor& param, const at::Tensor& value, const std::string& what) {
  if (param.sizes() != value.sizes()) {
    throw std::invalid_argument(what + ": shard has shape " + shape_str(value.sizes()) +
                                ", the parameter " + shape_str(param.sizes()));
  }
  torch::NoGradGuard no_grad;
  param.copy_(value.to(param.device(), param.scalar_type()));
}

}  // namespace

// ----- shard arithmetic ----------------------------------------------------------------------

int64_t ShardSpec::split_dim(const at::Tensor& full) const {
  switch (kind) {
    case Kind::kColumns: return full.dim() - 1;
    case Kind::kRows: return 0;
    case Kind::kReplicated: break;
  }
  return -1;
}

at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("shard_tensor: rank " + std::to_string(rank) +
                                " outside [0, " + std::to_string(world_size) + ")");
  }
  if (spec.kind == ShardSpec::Kind::kReplicated) return full;
  if (full.dim() == 0) throw std::invalid_argument("shard_tensor: a scalar cannot be split");
  const int64_t dim = spec.split_dim(full);
  const int64_t parts = spec.kind == ShardSpec::Kind::kColumns ? spec.fused_parts : 1;
  const int64_t extent = full.size(dim);
  if (parts < 1 || extent % (parts * world_size) != 0) {
    throw std::invalid_argument("shard_tensor: dimension " + std::to_string(dim) + " of shape " +
                                shape_str(full.sizes()) + " is not divisible into " +
                                std::to_string(parts) + " fused part(s) x " +
                                std::to_string(world_size) + " ranks");
  }
  const int64_t block = extent / parts, width = block / world_size;
  std::vector<at::Tensor> pieces;
  for (int64_t p = 0; p < parts; ++p) pieces.push_back(full.narrow(dim, p * block + rank * width, width));
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
  const int64_t dim = spec.split_dim(shards.front());
  const int64_t parts = spec.kind == ShardSpec::Kind::kColumns ? spec.fused_parts : 1;
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

// ----- ColumnParallelLinear ------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options,
                                                   dp::DistContext tp)
    : options_(options), tp_(std::move(tp)) {
  const int size = group_size(tp_, "ColumnParallelLinear");
  if (options_.in_features <= 0) {
    throw std::invalid_argument("ColumnParallelLinear: in_features " +
                                std::to_string(options_.in_features) + " must be positive");
  }
  require_divisible("ColumnParallelLinear", "out_features", options_.out_features,
                    size * options_.fused_parts,
                    "tensor-parallel size " + std::to_string(size) + " x fused parts " +
                        std::to_string(options_.fused_parts));
  const int64_t local_out = options_.out_features / size;
  weight = register_parameter("weight", torch::empty({options_.in_features, local_out}).normal_(0, 0.02));
  if (options_.bias) bias = register_parameter("bias", torch::zeros({local_out}));
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  if (x.size(-1) != options_.in_features) {
    throw std::invalid_argument("ColumnParallelLinear: input has " + std::to_string(x.size(-1)) +
                                " features (shape " + shape_str(x.sizes()) + "), expected " +
                                std::to_string(options_.in_features));
  }
  auto y = conv1d(copy_to_tp_region(x, tp_), weight, bias);
  return options_.gather_output ? gather_from_tp_region(y, tp_) : y;
}

void ColumnParallelLinearImpl::load_full(const at::Tensor& full_weight, const at::Tensor& full_bias) {
  copy_checked(weight, shard_tensor(full_weight, weight_spec(), tp_.rank, tp_.world_size),
               "ColumnParallelLinear weight (unsplit " + shape_str(full_weight.sizes()) + ")");
  if (bias.defined()) {
    copy_checked(bias, shard_tensor(full_bias, bias_spec(), tp_.rank, tp_.world_size),
                 "ColumnParallelLinear bias (unsplit " + shape_str(full_bias.sizes()) + ")");
  }
}

// ----- RowParallelLinear ---------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(const RowParallelLinearOptions& options, dp::DistContext tp)
    : options_(options), tp_(std::move(tp)) {
  const int size = group_size(tp_, "RowParallelLinear");
  require_divisible("RowParallelLinear", "in_features", options_.in_features, size,
                    "tensor-parallel size");
  if (options_.out_features <= 0) {
    throw std::invalid_argument("RowParallelLinear: out_features " +
                                std::to_string(options_.out_features) + " must be positive");
  }
  weight = register_parameter(
      "weight", torch::empty({options_.in_features / size, options_.out_features}).normal_(0, 0.02));
  if (options_.bias) bias = register_parameter("bias", torch::zeros({options_.out_features}));
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor local = options_.input_is_parallel ? x : scatter_to_tp_region(x, tp_);
  if (local.size(-1) != weight.size(0)) {
    throw std::invalid_argument("RowParallelLinear: input slice has " + std::to_string(local.size(-1)) +
                                " features (shape " + shape_str(local.sizes()) + "), expected " +
                                std::to_string(weight.size(0)) + " (in_features " +
                                std::to_string(options_.in_features) + " / " +
                                std::to_string(tp_.world_size) + " ranks)");
  }
  auto y = reduce_from_tp_region(conv1d(local, weight, at::Tensor()), tp_);
  return bias.defined() ? y + bias : y;
}

void RowParallelLinearImpl::load_full(const at::Tensor& full_weight, const at::Tensor& full_bias) {
  copy_checked(weight, shard_tensor(full_weight, weight_spec(), tp_.rank, tp_.world_size),
               "RowParallelLinear weight (unsplit " + shape_str(full_weight.sizes()) + ")");
  if (bias.defined()) copy_checked(bias, full_bias, "RowParallelLinear bias");
}

}  // namespace harness::tensor_parallel
