// ZeRO's ways of keeping a layout's AdamW state (see moments.h).
#include "harness/zero/moments.h"

#include <torch/torch.h>

#include <map>
#include <stdexcept>
#include <string>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/optim/fused_adamw.h"
#include "harness/zero/sharded_adamw.h"

namespace harness::zero {
namespace {

using train::HeldAdamW;
using train::KeptTensors;
using train::NamedParameters;
using train::OptimizerSettings;
using train::OptimizerState;

// ZeRO-1 and ZeRO-2 (sharded_adamw.h): `buckets` (kReduceScatter or kShardedGradients, the step's
// synchronizer) is attached to the held parameters here; a walk over the parameters gathers one
// bucket's moments (or averaged gradients) at a time over the data-parallel group.
class ShardedMoments final : public HeldAdamW {
 public:
  ShardedMoments(NamedParameters held, const OptimizerSettings& settings, data_parallel::BucketedAllReduce& buckets)
      : held_(std::move(held)), buckets_(buckets) {
    std::vector<at::Tensor> tensors;
    for (const auto& [name, p] : held_) tensors.push_back(p);
    buckets_.attach(tensors);
    optim::AdamWHyperparameters options;
    options.lr = settings.learning_rate;
    options.weight_decay = settings.weight_decay;
    adam_ = std::make_unique<ShardedAdamW>(buckets_, tensors, options);
    const auto& plan = buckets_.bucket_plan();
    place_.assign(held_.size(), {kNone, 0});
    const int rank = buckets_.context().rank;
    for (size_t b = 0; b < plan.size(); ++b) {
      int64_t offset = 0;
      for (size_t k = 0; k < plan[b].size(); ++k) {
        const size_t index = plan[b][k];
        place_[index] = {b, k};
        const int64_t n = tensors[index].numel();
        const data_parallel::ChunkOverlap mine = data_parallel::chunk_overlap(rank, buckets_.chunk_elements(b), offset, n);
        if (mine.length > 0) pieces_.push_back({b, index, mine.in_chunk, mine.length});
        offset += n;
      }
    }
  }

  void zero_grad() override {
    forget_gathered();
    buckets_.discard_shards();  // ZeRO-2 accumulates a step's batches into them
    for (auto& [name, p] : held_) p.mutable_grad() = at::Tensor();
  }
  // Each parameter's part of a chunk on its own, as clip_grad_norm_ norms each gradient (one fp32
  // norm over a whole bucket rounds several times more).
  void for_each_gradient(const std::function<void(size_t, const at::Tensor&)>& visit) const override {
    for (const Piece& piece : pieces_) {
      visit(piece.parameter, buckets_.gradient_shard(piece.bucket).narrow(0, piece.chunk_offset, piece.length));
    }
  }
  const data_parallel::DistContext* shard_group() const override { return &buckets_.context(); }
  void scale_gradients(double factor) override {
    torch::NoGradGuard no_grad;
    for (size_t b = 0; b < buckets_.bucket_plan().size(); ++b) buckets_.gradient_shard(b).mul_(factor);
  }
  void step() override { adam_->step(); }
  void keep_for_undo() override {
    kept_.keep(adam_->written_by_step());
    kept_steps_ = adam_->steps();
  }
  void undo_step() override {
    kept_.restore();
    adam_->set_steps(kept_steps_);
  }
  void forget_undo() override { kept_.clear(); }
  void set_learning_rate(double learning_rate) override { adam_->set_learning_rate(learning_rate); }
  double learning_rate() const override { return adam_->learning_rate(); }
  int64_t state_bytes() const override { return adam_->state_bytes(); }
  std::optional<int64_t> steps_of(size_t i) const override {
    if (place_.at(i).first == kNone || adam_->steps() == 0) return std::nullopt;
    return adam_->steps();
  }
  std::pair<at::Tensor, at::Tensor> moments(size_t i) override {
    const auto [b, k] = place_.at(i);
    if (moments_bucket_ != b) {
      moments_ = adam_->gather_bucket_moments(b);
      moments_bucket_ = b;
    }
    return {moments_.first.at(k), moments_.second.at(k)};
  }
  at::Tensor gradient(size_t i) override {
    const auto [b, k] = place_.at(i);
    if (b == kNone) return at::Tensor();
    if (gradients_bucket_ != b) {
      gradients_ = buckets_.gather_bucket(b, buckets_.gradient_shard(b));
      gradients_bucket_ = b;
    }
    return gradients_.at(k);
  }
  void forget_gathered() override {
    moments_ = {};
    gradients_.clear();
    moments_bucket_ = gradients_bucket_ = kNone;
  }
  void load(const OptimizerState& state) override;

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  struct Piece {  // the part of a held parameter inside this rank's chunk of its bucket
    size_t bucket, parameter;
    int64_t chunk_offset, length;
  };
  NamedParameters held_;
  data_parallel::BucketedAllReduce& buckets_;
  std::unique_ptr<ShardedAdamW> adam_;
  std::vector<std::pair<size_t, size_t>> place_;  // held parameter -> (bucket, position in it)
  std::vector<Piece> pieces_;
  size_t moments_bucket_ = kNone, gradients_bucket_ = kNone;
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> moments_;
  std::vector<at::Tensor> gradients_;
  KeptTensors kept_;
  int64_t kept_steps_ = 0;
};

void ShardedMoments::load(const OptimizerState& state) {
  ShardedAdamW::FullState full;
  if (!state.empty()) {
    full.moments.resize(held_.size());
    full.step = state.begin()->second.step;
    std::map<std::string, size_t> index_of;
    for (size_t i = 0; i < held_.size(); ++i) index_of[held_[i].first] = i;
    // Every entry is checked on every rank (not only the chunks this rank keeps), so that a bad
    // checkpoint fails on all ranks alike instead of leaving some to wait.
    for (const auto& [name, s] : state) {
      const size_t i = index_of.at(name);
      if (s.step != full.step) {
        throw std::invalid_argument("optimizer state: " + name + " took " + std::to_string(s.step) +
                                    " steps, other parameters " + std::to_string(full.step) +
                                    "; --zero_stage 1 steps every parameter together");
      }
      for (const at::Tensor* moment : {&s.exp_avg, &s.exp_avg_sq}) {
        if (!moment->defined() || moment->sizes() != held_[i].second.sizes()) {
          throw std::invalid_argument("optimizer state of " + name + " does not have the parameter's shape");
        }
      }
      full.moments[i] = {s.exp_avg, s.exp_avg_sq};
    }
    for (size_t i = 0; i < held_.size(); ++i) {
      if (held_[i].second.requires_grad() && !full.moments[i].first.defined()) {
        throw std::invalid_argument("optimizer state: none for " + held_[i].first + ", which --zero_stage 1 steps");
      }
    }
  }
  adam_->load_state(full);
}

// ZeRO-3 (sharded_units.h): the weights, gradients and AdamW moments of every held parameter
// are `units`' chunks over the data-parallel group (the units are the step's synchronizer). A walk
// over the parameters gathers one unit's weights, moments or gradients at a time.
class UnitMoments final : public HeldAdamW {
 public:
  UnitMoments(const NamedParameters& held, const OptimizerSettings& settings, ShardedUnits& units)
      : units_(units) {
    options_.lr = settings.learning_rate;
    options_.weight_decay = settings.weight_decay;
    std::map<std::string, std::pair<size_t, size_t>> place_of;
    for (size_t u = 0; u < units_.size(); ++u) {
      for (size_t k = 0; k < units_.unit(u).names.size(); ++k) place_of[units_.unit(u).names[k]] = {u, k};
      exp_avg_.push_back(torch::zeros_like(units_.weight_chunk(u)));
      exp_avg_sq_.push_back(torch::zeros_like(units_.weight_chunk(u)));
    }
    const int64_t rank = units_.context().rank;
    for (size_t i = 0; i < held.size(); ++i) {
      auto it = place_of.find(held[i].first);
      if (it == place_of.end()) throw std::invalid_argument("--zero_stage 3: " + held[i].first + " is in no unit");
      place_.push_back(it->second);
      const auto [u, k] = it->second;
      const data_parallel::ChunkOverlap mine =
          data_parallel::chunk_overlap(rank, units_.chunk_elements(u), units_.offset_of(u, k), held[i].second.numel());
      if (mine.length > 0) pieces_.push_back({i, u, mine.in_chunk, mine.length});
    }
  }

  void zero_grad() override {
    forget_gathered();
    units_.release_all();  // an evaluation's or a checkpoint's full copies
    units_.discard_gradients();
  }
  void for_each_gradient(const std::function<void(size_t, const at::Tensor&)>& visit) const override {
    for (const Piece& piece : pieces_) {
      visit(piece.parameter, units_.gradient_chunk(piece.unit).narrow(0, piece.chunk_offset, piece.length));
    }
  }
  const data_parallel::DistContext* shard_group() const override { return &units_.context(); }
  void scale_gradients(double factor) override {
    torch::NoGradGuard no_grad;
    for (size_t u = 0; u < units_.size(); ++u) units_.gradient_chunk(u).mul_(factor);
  }
  void step() override {
    torch::NoGradGuard no_grad;
    ++step_;
    for (size_t u = 0; u < units_.size(); ++u) {
      optim::fused_adamw_update({units_.weight_chunk(u)}, {units_.gradient_chunk(u)}, {exp_avg_[u]}, {exp_avg_sq_[u]},
                                step_, options_);
    }
  }
  // This rank's chunks of the weights and of both moments, and the step count.
  void keep_for_undo() override {
    std::vector<at::Tensor> written;
    for (size_t u = 0; u < units_.size(); ++u) {
      written.insert(written.end(), {units_.weight_chunk(u), exp_avg_[u], exp_avg_sq_[u]});
    }
    kept_.keep(std::move(written));
    kept_step_ = step_;
  }
  void undo_step() override {
    kept_.restore();
    step_ = kept_step_;
  }
  void forget_undo() override { kept_.clear(); }
  void set_learning_rate(double learning_rate) override { options_.lr = learning_rate; }
  double learning_rate() const override { return options_.lr; }
  int64_t state_bytes() const override {
    int64_t bytes = 0;
    for (size_t u = 0; u < exp_avg_.size(); ++u) bytes += exp_avg_[u].nbytes() + exp_avg_sq_[u].nbytes();
    return bytes;
  }
  std::optional<int64_t> steps_of(size_t) const override {
    if (step_ == 0) return std::nullopt;
    return step_;
  }
  std::pair<at::Tensor, at::Tensor> moments(size_t i) override {
    at::Tensor first = gathered(first_moments_, i, [&](size_t u) { return exp_avg_[u]; });
    return {first, gathered(second_moments_, i, [&](size_t u) { return exp_avg_sq_[u]; })};
  }
  at::Tensor gradient(size_t i) override { return gathered(gradients_, i, [&](size_t u) { return units_.gradient_chunk(u); }); }
  void forget_gathered() override { first_moments_ = second_moments_ = weights_ = gradients_ = {}; }
  void load(const OptimizerState& state) override;

  bool keeps_weights() const override { return true; }
  at::Tensor weight(size_t i) override { return gathered(weights_, i, [&](size_t u) { return units_.weight_chunk(u); }); }
  void load_weight(size_t i, const at::Tensor& local) override {
    units_.release_all();
    const auto [u, k] = place_.at(i);
    units_.copy_into_chunk(u, k, local, units_.weight_chunk(u));
  }
  void gather_weights() override {
    units_.release_all();  // copies gathered before the last step are stale
    units_.gather_all();
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  struct Piece {  // the part of a held parameter inside this rank's chunk of its unit
    size_t parameter, unit;
    int64_t chunk_offset, length;
  };
  struct Gathered {  // one unit's chunks of something, every rank's together, a view per parameter
    size_t unit = kNone;
    std::vector<at::Tensor> parts;
  };
  // Held parameter i's part of what `chunk_of` gives for each unit, its unit gathered unless it
  // is the one `cache` holds (collective).
  at::Tensor gathered(Gathered& cache, size_t i, const std::function<at::Tensor(size_t)>& chunk_of) {
    const auto [u, k] = place_.at(i);
    if (cache.unit != u) cache = {u, units_.gather_unit(u, chunk_of(u))};
    return cache.parts.at(k);
  }

  ShardedUnits& units_;
  optim::AdamWHyperparameters options_;
  std::vector<std::pair<size_t, size_t>> place_;  // held parameter -> (unit, position in it)
  std::vector<Piece> pieces_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
  Gathered first_moments_, second_moments_, weights_, gradients_;
  KeptTensors kept_;
  int64_t kept_step_ = 0;
};

void UnitMoments::load(const OptimizerState& state) {
  for (size_t u = 0; u < units_.size(); ++u) {
    exp_avg_[u].zero_();
    exp_avg_sq_[u].zero_();
  }
  step_ = state.empty() ? 0 : state.begin()->second.step;
  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < place_.size(); ++i) {
    const auto [u, k] = place_[i];
    index_of[units_.unit(u).names[k]] = i;
  }
  for (const auto& [name, s] : state) {
    if (s.step != step_) {
      throw std::invalid_argument("optimizer state: " + name + " took " + std::to_string(s.step) + " steps, other parameters " +
                                  std::to_string(step_) + "; --zero_stage 3 steps every parameter together");
    }
    const auto [u, k] = place_.at(index_of.at(name));
    units_.copy_into_chunk(u, k, s.exp_avg, exp_avg_[u]);
    units_.copy_into_chunk(u, k, s.exp_avg_sq, exp_avg_sq_[u]);
  }
  if (!state.empty() && state.size() != index_of.size()) {
    for (const auto& [name, i] : index_of) {
      if (!state.count(name)) throw std::invalid_argument("optimizer state: none for " + name + ", which --zero_stage 3 steps");
    }
  }
}

}  // namespace

std::unique_ptr<HeldAdamW> sharded_moments(NamedParameters held, const OptimizerSettings& settings,
                                           data_parallel::BucketedAllReduce& buckets) {
  return std::make_unique<ShardedMoments>(std::move(held), settings, buckets);
}

std::unique_ptr<HeldAdamW> unit_moments(const NamedParameters& held, const OptimizerSettings& settings,
                                        ShardedUnits& units) {
  return std::make_unique<UnitMoments>(held, settings, units);
}

train::HeldAdamWFactory sharded_state(const train::OptimizerSettings& settings, data_parallel::BucketedAllReduce& buckets) {
  return [settings, &buckets](const train::NamedParameters& held) { return sharded_moments(held, settings, buckets); };
}

train::HeldAdamWFactory unit_state(const train::OptimizerSettings& settings, ShardedUnits& units) {
  return [settings, &units](const train::NamedParameters& held) { return unit_moments(held, settings, units); };
}

}  // namespace harness::zero
