// ShardedAdamW (see sharded_adamw.h). A bucket's flat layout is its parameters, each flattened, in
// bucket_plan() order (as BucketedAllReduce concatenates them), zero-padded to world size x chunk;
// rank r owns [r * chunk, (r + 1) * chunk).
#include "harness/zero/sharded_adamw.h"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

namespace harness::zero {

using data_parallel::ChunkOverlap;
using data_parallel::chunk_overlap;
using data_parallel::DistContext;

ShardedAdamW::ShardedAdamW(const BucketedAllReduce& gradients, std::vector<at::Tensor> parameters,
                           AdamWHyperparameters options)
    : gradients_(gradients), parameters_(std::move(parameters)), options_(options) {
  const DistContext& ctx = gradients_.context();
  const auto& plan = gradients_.bucket_plan();
  for (size_t b = 0; b < plan.size(); ++b) {
    Shard shard;
    shard.bucket = b;
    shard.chunk = gradients_.chunk_elements(b);
    int64_t offset = 0;
    for (size_t index : plan[b]) {
      const at::Tensor& p = parameters_.at(index);
      if (!p.is_contiguous()) {
        throw std::invalid_argument("--zero_stage 1: parameter " + std::to_string(index) + " is not contiguous");
      }
      const int64_t n = p.numel();
      const ChunkOverlap mine = chunk_overlap(ctx.rank, shard.chunk, offset, n);
      if (mine.length > 0) shard.pieces.push_back({index, mine.in_tensor, mine.in_chunk, mine.length});
      offset += n;
    }
    const auto options_of = parameters_.at(plan[b].front()).options();
    shard.exp_avg = torch::zeros({shard.chunk}, options_of);
    shard.exp_avg_sq = torch::zeros({shard.chunk}, options_of);
    shards_.push_back(std::move(shard));
  }
}

void ShardedAdamW::step() {
  torch::NoGradGuard no_grad;
  ++step_;
  const auto& plan = gradients_.bucket_plan();
  // Each bucket's all-gather is launched as soon as its chunk is stepped, so it runs while the
  // next chunks are stepped and the earlier gathers are copied into the parameters.
  std::vector<BucketedAllReduce::BucketGather> gathers;
  gathers.reserve(shards_.size());
  for (Shard& shard : shards_) {
    const at::Tensor& grad = gradients_.gradient_shard(shard.bucket);
    at::Tensor mine = torch::zeros({shard.chunk}, shard.exp_avg.options());
    for (const Piece& piece : shard.pieces) {
      mine.narrow(0, piece.chunk_offset, piece.length)
          .copy_(parameters_[piece.parameter].detach().view(-1).narrow(0, piece.parameter_offset, piece.length));
    }
    // The replicated step's fused AdamW kernel, on the chunk.
    optim::fused_adamw_update({mine}, {grad}, {shard.exp_avg}, {shard.exp_avg_sq}, step_, options_);
    gathers.push_back(gradients_.start_gather(shard.bucket, mine));
    gathered_bytes_ += mine.numel() * static_cast<int64_t>(mine.element_size());
  }
  for (auto& gather : gathers) {
    const std::vector<at::Tensor> updated = gradients_.finish_gather(gather);
    for (size_t k = 0; k < updated.size(); ++k) parameters_[plan[gather.bucket][k]].detach().copy_(updated[k]);
  }
}

std::vector<at::Tensor> ShardedAdamW::written_by_step() const {
  std::vector<at::Tensor> written = parameters_;
  for (const Shard& shard : shards_) written.insert(written.end(), {shard.exp_avg, shard.exp_avg_sq});
  return written;
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> ShardedAdamW::gather_bucket_moments(size_t b) const {
  const Shard& shard = shards_.at(b);
  return {gradients_.gather_bucket(shard.bucket, shard.exp_avg), gradients_.gather_bucket(shard.bucket, shard.exp_avg_sq)};
}

ShardedAdamW::FullState ShardedAdamW::gather_state() const {
  torch::NoGradGuard no_grad;
  FullState out;
  out.step = step_;
  if (step_ == 0) return out;
  out.moments.resize(parameters_.size());
  const auto& plan = gradients_.bucket_plan();
  for (const Shard& shard : shards_) {
    const auto [exp_avg, exp_avg_sq] = gather_bucket_moments(shard.bucket);
    for (size_t k = 0; k < exp_avg.size(); ++k) {
      out.moments[plan[shard.bucket][k]] = {exp_avg[k].to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true),
                                            exp_avg_sq[k].to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true)};
    }
  }
  return out;
}

void ShardedAdamW::load_state(const FullState& state) {
  torch::NoGradGuard no_grad;
  step_ = state.step;
  for (Shard& shard : shards_) {
    shard.exp_avg.zero_();
    shard.exp_avg_sq.zero_();
  }
  if (state.moments.empty()) return;
  if (state.moments.size() != parameters_.size()) {
    throw std::invalid_argument("--zero_stage 1: optimizer state for " + std::to_string(state.moments.size()) +
                                " parameters, the model has " + std::to_string(parameters_.size()));
  }
  for (Shard& shard : shards_) {
    for (const Piece& piece : shard.pieces) {
      const auto& [exp_avg, exp_avg_sq] = state.moments[piece.parameter];
      const at::Tensor& p = parameters_[piece.parameter];
      for (const at::Tensor* moment : {&exp_avg, &exp_avg_sq}) {
        if (!moment->defined() || moment->numel() != p.numel()) {
          throw std::invalid_argument("--zero_stage 1: optimizer state of parameter " +
                                      std::to_string(piece.parameter) + " does not have its shape");
        }
      }
      shard.exp_avg.narrow(0, piece.chunk_offset, piece.length)
          .copy_(exp_avg.reshape({-1}).narrow(0, piece.parameter_offset, piece.length));
      shard.exp_avg_sq.narrow(0, piece.chunk_offset, piece.length)
          .copy_(exp_avg_sq.reshape({-1}).narrow(0, piece.parameter_offset, piece.length));
    }
  }
}

int64_t ShardedAdamW::state_bytes() const {
  int64_t bytes = 0;
  for (const Shard& shard : shards_) {
    bytes += (shard.exp_avg.numel() + shard.exp_avg_sq.numel()) * static_cast<int64_t>(shard.exp_avg.element_size());
  }
  return bytes;
}

}  // namespace harness::zero
