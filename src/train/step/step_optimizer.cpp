// The optimizer parts of a training step (see step_optimizer.h).
#include "harness/train/step/step_optimizer.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/process_group.h"
#include "harness/train/step/held_adamw.h"
#include "harness/model/safetensors.h"
#include "harness/optim/fused_adamw.h"

namespace harness::train {
namespace {

// The sum of the tensors' squared L2 norms, in double: each tensor's norm on its device
// (clip_grad_norm_'s per-tensor norms), one transfer per device.
double sum_of_squares(const std::vector<at::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> by_device;
  for (const at::Tensor& t : tensors) {
    auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& d) { return d.first == t.device(); });
    if (it == by_device.end()) it = by_device.insert(by_device.end(), {t.device(), {}});
    it->second.push_back(t);
  }
  double total = 0.0;
  for (const auto& [device, group] : by_device) {
    total += at::stack(at::_foreach_norm(group)).to(at::kDouble).square().sum().item<double>();
  }
  return total;
}

torch::optim::AdamWOptions adamw_options(const OptimizerSettings& settings) {
  return torch::optim::AdamWOptions(settings.learning_rate).weight_decay(settings.weight_decay);
}

// The rate of every parameter group of `optimizer` (a schedule's step), and the group's rate.
void set_adamw_learning_rate(torch::optim::AdamW& optimizer, double learning_rate) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate);
  }
}
double adamw_learning_rate(const torch::optim::AdamW& optimizer) {
  return static_cast<const torch::optim::AdamWOptions&>(optimizer.param_groups().front().options()).lr();
}

// Bytes of AdamW's two moments held by `optimizer`.
int64_t adamw_state_bytes(const torch::optim::AdamW& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
    bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
  }
  return bytes;
}

}  // namespace

void KeptTensors::keep(std::vector<at::Tensor> tensors) {
  torch::NoGradGuard no_grad;
  originals_ = std::move(tensors);
  copies_.clear();
  copies_.reserve(originals_.size());
  for (const at::Tensor& t : originals_) copies_.push_back(t.detach().clone());
}

void KeptTensors::restore() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < originals_.size(); ++i) originals_[i].detach().copy_(copies_[i]);
}

void KeptTensors::clear() {
  originals_.clear();
  copies_.clear();
}

namespace {

// ----- The parts of a layout's AdamW -----
//
// Every layout's optimizer is one LayoutAdamW: where this rank's parameters are (all of them, or
// the ones its pipeline stages hold, each owned by one stage) and how their AdamW state is kept
// (whole on this rank, or ZeRO's chunks over the data-parallel group). The norm, the clipping,
// checkpoints and the --pytest gradients are written once, over those two parts; tensor
// parallelism (each rank's slices, unsplit over its group) composes with both.


class WholeMoments final : public HeldAdamW {
 public:
  WholeMoments(NamedParameters held, const OptimizerSettings& settings) : held_(std::move(held)) {
    std::vector<at::Tensor> tensors;
    for (const auto& [name, p] : held_) tensors.push_back(p);
    optimizer_ = std::make_unique<optim::FusedAdamW>(tensors, adamw_options(settings));
  }
  void zero_grad() override { optimizer_->zero_grad(); }
  void for_each_gradient(const std::function<void(size_t, const at::Tensor&)>& visit) const override {
    for (size_t i = 0; i < held_.size(); ++i) {
      if (held_[i].second.grad().defined()) visit(i, held_[i].second.grad());
    }
  }
  void scale_gradients(double factor) override {
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : held_) {
      if (p.grad().defined()) p.grad().mul_(factor);
    }
  }
  void step() override { optimizer_->step(); }
  // The weights, and the moments and step counts of the parameters that have state (AdamW
  // creates a parameter's state at its first step: an undo removes it again).
  void keep_for_undo() override {
    std::vector<at::Tensor> written;
    kept_steps_.clear();
    for (size_t i = 0; i < held_.size(); ++i) {
      written.push_back(held_[i].second);
      if (const torch::optim::AdamWParamState* s = state_of(i)) {
        written.push_back(s->exp_avg());
        written.push_back(s->exp_avg_sq());
        kept_steps_[i] = s->step();
      }
    }
    kept_.keep(std::move(written));
  }
  void undo_step() override {
    kept_.restore();
    auto& states = optimizer_->state();
    for (size_t i = 0; i < held_.size(); ++i) {
      auto it = states.find(held_[i].second.unsafeGetTensorImpl());
      if (it == states.end()) continue;
      auto kept = kept_steps_.find(i);
      if (kept == kept_steps_.end()) {
        states.erase(it);
      } else {
        static_cast<torch::optim::AdamWParamState&>(*it->second).step(kept->second);
      }
    }
  }
  void forget_undo() override {
    kept_.clear();
    kept_steps_.clear();
  }
  void set_learning_rate(double learning_rate) override { set_adamw_learning_rate(*optimizer_, learning_rate); }
  double learning_rate() const override { return adamw_learning_rate(*optimizer_); }
  int64_t state_bytes() const override { return adamw_state_bytes(*optimizer_); }
  std::optional<int64_t> steps_of(size_t i) const override {
    const torch::optim::AdamWParamState* s = state_of(i);
    if (s == nullptr) return std::nullopt;
    return s->step();
  }
  std::pair<at::Tensor, at::Tensor> moments(size_t i) override {
    const torch::optim::AdamWParamState* s = state_of(i);
    return {s->exp_avg(), s->exp_avg_sq()};
  }
  at::Tensor gradient(size_t i) override { return held_.at(i).second.grad(); }
  void load(const OptimizerState& state) override { restore_adamw_state(*optimizer_, held_, state); }

 private:
  const torch::optim::AdamWParamState* state_of(size_t i) const {
    auto& states = optimizer_->state();
    auto it = states.find(held_.at(i).second.unsafeGetTensorImpl());
    return it == states.end() ? nullptr : static_cast<const torch::optim::AdamWParamState*>(it->second.get());
  }
  NamedParameters held_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  KeptTensors kept_;
  std::map<size_t, int64_t> kept_steps_;
};

// Where this rank's parameters are in the layout: all of them here (no pipeline), or the ones its
// pipeline stages hold, each parameter owned by one stage (wte by the first, its copy on the last
// stage kept equal by the embedding group's gradient sum).
struct Placement {
  NamedParameters held;                       // in the model's order
  std::map<std::string, int> owner;           // with a pipeline: each parameter's pipeline rank
  std::optional<data_parallel::DistContext> pipeline;
  bool post_validate = false;                 // see PipelineStageParameters
};

class LayoutAdamW final : public StepOptimizer {
 public:
  // `make_state` builds how the held parameters' AdamW state is kept, from the held parameters.
  LayoutAdamW(model::GPT2LMHeadModel model, const OptimizerSettings& settings, Placement placement,
              const std::function<std::unique_ptr<HeldAdamW>(const NamedParameters&)>& make_state)
      : model_(std::move(model)), settings_(settings), placement_(std::move(placement)) {
    for (size_t i = 0; i < placement_.held.size(); ++i) held_index_[placement_.held[i].first] = i;
    if (placement_.pipeline) {
      for (const auto& item : model_->named_parameters()) {
        if (!placement_.owner.count(item.key())) throw std::invalid_argument("stage_adamw: no stage owns " + item.key());
        if (!held_index_.count(item.key())) others_.push_back({item.key(), item.value(), item.value().sizes().vec()});
      }
    }
    state_ = make_state(placement_.held);
    release_others();
  }

  // A step needs only this rank's stages: the others' weights, brought here for an evaluation or
  // a checkpoint, are let go again.
  void zero_grad() override {
    release_others();
    state_->zero_grad();
  }
  void step() override;
  void set_learning_rate(double learning_rate) override { state_->set_learning_rate(learning_rate); }
  double learning_rate() const override { return state_->learning_rate(); }
  bool collective_state() const override {
    return placement_.pipeline || model_->tensor_parallel() != nullptr || state_->shard_group() != nullptr;
  }
  OptimizerState state() override;
  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override;
  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override;
  OptimizerState local_state() override;
  void load_local_state(const OptimizerState& state) override;
  model::NamedTensors unsplit_gradients() override;
  bool stream_weights(const std::string& path, bool write) override;
  int64_t state_bytes() const override { return state_->state_bytes(); }
  void gather_weights() override;

 private:
  int rank() const { return placement_.pipeline ? placement_.pipeline->rank : 0; }
  int owner_of(const std::string& name) const { return placement_.pipeline ? placement_.owner.at(name) : 0; }
  std::optional<size_t> held_index(const std::string& name) const {
    auto it = held_index_.find(name);
    if (it == held_index_.end()) return std::nullopt;
    return it->second;
  }
  bool is_split(const std::string& name) const {
    return model_->tensor_parallel() != nullptr &&
           model_->shards().at(name).spec.kind != model::ShardSpec::Kind::kReplicated;
  }
  // Broadcasts `tensor` (this rank's copy, overwritten) from pipeline rank `root`.
  void broadcast_from(int root, at::Tensor& tensor) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    placement_.pipeline->group->broadcast(tensors, options)->wait();
  }
  c10::Device device() const { return model_->first_device().torch_device(); }

  // Whether each parameter has AdamW state, and its step, as its owner says (with a pipeline, a
  // collective over its group, in the model's order).
  struct Header {
    std::string name;
    bool has_state = false;
    int64_t step = 0;
  };
  std::vector<Header> headers();
  // Each parameter's weight (or, with `headers`, each stepped parameter's two moments) from its
  // owner, unsplit over the tensor-parallel group, handed to `take` one at a time and then let go:
  // no rank ever holds more than one unsplit tensor (or pair) it does not keep.
  void for_each_weight(const std::function<void(const std::string&, const at::Tensor&)>& take);
  void for_each_moment(const std::vector<Header>& headers,
                       const std::function<void(const Header&, const at::Tensor&, const at::Tensor&)>& take);

  // The parameters of other stages hold no storage between gathers (an empty tensor of their
  // dtype and device), so a stage process keeps only its own stages' weights while it trains.
  void release_others() {
    torch::NoGradGuard no_grad;
    for (Other& o : others_) {
      if (o.tensor.numel() != 0) o.tensor.set_data(at::empty({0}, o.tensor.options()));
    }
  }
  void materialize_others() {
    torch::NoGradGuard no_grad;
    for (Other& o : others_) {
      if (o.tensor.sizes() != at::IntArrayRef(o.shape)) o.tensor.set_data(at::empty(o.shape, o.tensor.options()));
    }
  }
  // The shape of a parameter on this rank (its slice, when split), whether its storage is here or not.
  std::vector<int64_t> shape_of(const std::string& name, const at::Tensor& tensor) const {
    for (const Other& o : others_) {
      if (o.name == name) return o.shape;
    }
    return tensor.sizes().vec();
  }

  struct Other {
    std::string name;
    at::Tensor tensor;
    std::vector<int64_t> shape;
  };
  model::GPT2LMHeadModel model_;
  OptimizerSettings settings_;
  Placement placement_;
  std::map<std::string, size_t> held_index_;
  std::vector<Other> others_;
  std::unique_ptr<HeldAdamW> state_;
  bool last_step_as_is_ = false;  // the last step neither clipped nor skipped (none yet: false)
};

void LayoutAdamW::step() {
  // The squares of the gradient as one device would sum them: each stage counts what it owns (wte
  // once, on the first stage, whose gradient already holds the head's); ZeRO's chunks are summed
  // over the data-parallel group; a gradient split over a tensor-parallel group is its slices
  // together, so their squares are summed over the group, and a replicated one is counted once.
  std::vector<at::Tensor> split, replicated;
  state_->for_each_gradient([&](size_t i, const at::Tensor& gradient) {
    const std::string& name = placement_.held[i].first;
    if (owner_of(name) != rank()) return;
    (is_split(name) ? split : replicated).push_back(gradient);
  });
  double split_squares = sum_of_squares(split), replicated_squares = sum_of_squares(replicated);
  if (const data_parallel::DistContext* shards = state_->shard_group(); shards != nullptr && shards->world_size > 1) {
    std::vector<at::Tensor> both{
        torch::tensor({split_squares, replicated_squares}, torch::kDouble).to(shards->device.torch_device())};
    shards->group->allreduce(both)->wait();
    const at::Tensor summed = both[0].to(torch::kCPU);
    split_squares = summed[0].item<double>();
    replicated_squares = summed[1].item<double>();
  }
  if (model::TensorParallelGroup* group = model_->tensor_parallel()) {
    const at::Tensor mine = torch::tensor({split_squares}, torch::kDouble).to(device());
    split_squares = 0.0;
    for (const at::Tensor& part : group->all_gather(mine)) split_squares += part.to(torch::kCPU).item<double>();
  }
  double squares = split_squares + replicated_squares;
  bool stepped_early = false;
  if (placement_.pipeline) {
    std::vector<at::Tensor> total{torch::tensor({squares}, torch::kDouble).to(placement_.pipeline->device.torch_device())};
    const c10::intrusive_ptr<c10d::Work> other_stages = placement_.pipeline->group->allreduce(total);
    // Optimizer post-validation (Qi et al., ICLR 2024): while the other stages' squares are on
    // their way, step as if clipping will not apply and nothing is infinite, keeping what is
    // needed to undo it. It waits instead where that guess is likely wrong: after a step that was
    // clipped or skipped (norms change slowly), and where this stage's own squares, a lower bound
    // of the total, already say the step must be clipped or skipped.
    if (placement_.post_validate && last_step_as_is_ && std::isfinite(squares) &&
        clip_coefficient(std::sqrt(squares), settings_.max_grad_norm) >= 1.0) {
      state_->keep_for_undo();
      state_->step();
      stepped_early = true;
      ++post_validation_.early;
    }
    other_stages->wait();
    squares = total[0].to(torch::kCPU).item<double>();
  }
  last_grad_norm_ = std::sqrt(squares);
  const double coefficient = clip_coefficient(last_grad_norm_, settings_.max_grad_norm);
  const bool take_as_is = std::isfinite(last_grad_norm_) && coefficient >= 1.0;
  last_step_as_is_ = take_as_is;
  if (before_update_) {
    try {
      before_update_();
    } catch (...) {
      if (stepped_early) {  // nothing changes: bit for bit the state before the step
        state_->undo_step();
        state_->forget_undo();
      }
      throw;
    }
  }
  if (stepped_early) {
    if (!take_as_is) {
      state_->undo_step();  // bit for bit the state before it: the synchronous step follows
      ++post_validation_.undone;
    }
    state_->forget_undo();
    if (take_as_is) return;
  }
  // A gradient with a NaN or an infinity anywhere would carry it into every weight through AdamW's
  // moments. Every rank has the same norm here, so every rank skips the step alike (as PyTorch's
  // GradScaler skips one): weights, moments and step counts stay as they were.
  if (!std::isfinite(last_grad_norm_)) {
    std::cerr << "optimizer: the global gradient norm is " << last_grad_norm_
              << "; this step is skipped (weights and AdamW state unchanged)" << std::endl;
    return;
  }
  if (coefficient < 1.0) state_->scale_gradients(coefficient);
  state_->step();
}

void LayoutAdamW::gather_weights() {
  if (state_->keeps_weights()) state_->gather_weights();
  if (!placement_.pipeline) return;
  materialize_others();
  torch::NoGradGuard no_grad;
  for (const auto& item : model_->named_parameters()) {
    at::Tensor weight = item.value();
    broadcast_from(owner_of(item.key()), weight);
  }
}

std::vector<LayoutAdamW::Header> LayoutAdamW::headers() {
  std::vector<Header> out;
  for (const auto& item : model_->named_parameters()) {
    const int owner = owner_of(item.key());
    const std::optional<size_t> held = held_index(item.key());
    // Its AdamW step count where this rank holds its state, else -1.
    const int64_t steps = owner == rank() && held ? state_->steps_of(*held).value_or(-1) : -1;
    if (!placement_.pipeline) {
      out.push_back({item.key(), steps >= 0, std::max<int64_t>(steps, 0)});
      continue;
    }
    at::Tensor header = steps >= 0 ? torch::tensor({1.0, static_cast<double>(steps)}, torch::kDouble)
                                   : torch::zeros({2}, torch::kDouble);
    header = header.to(placement_.pipeline->device.torch_device());
    broadcast_from(owner, header);
    header = header.to(torch::kCPU);
    out.push_back({item.key(), header[0].item<double>() != 0.0, static_cast<int64_t>(header[1].item<double>())});
  }
  return out;
}

void LayoutAdamW::for_each_weight(const std::function<void(const std::string&, const at::Tensor&)>& take) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model_->named_parameters()) {
    const int owner = owner_of(item.key());
    at::Tensor weight = owner != rank() ? at::empty(shape_of(item.key(), item.value()), item.value().options())
                        : state_->keeps_weights() ? state_->weight(*held_index(item.key())).contiguous()
                                                  : item.value().detach().contiguous();
    if (placement_.pipeline) broadcast_from(owner, weight);
    if (model_->tensor_parallel() != nullptr) weight = model_->unshard(item.key(), weight);
    take(item.key(), weight);
  }
  state_->forget_gathered();
}

void LayoutAdamW::for_each_moment(const std::vector<Header>& headers,
                                  const std::function<void(const Header&, const at::Tensor&, const at::Tensor&)>& take) {
  torch::NoGradGuard no_grad;
  size_t k = 0;
  for (const auto& item : model_->named_parameters()) {
    const Header& header = headers.at(k++);
    if (!header.has_state) continue;
    const int owner = owner_of(item.key());
    at::Tensor exp_avg, exp_avg_sq;
    if (owner == rank()) {
      std::tie(exp_avg, exp_avg_sq) = state_->moments(*held_index(item.key()));
      exp_avg = exp_avg.to(item.value().device(), item.value().scalar_type()).contiguous();
      exp_avg_sq = exp_avg_sq.to(item.value().device(), item.value().scalar_type()).contiguous();
    } else {
      const std::vector<int64_t> shape = shape_of(item.key(), item.value());
      exp_avg = at::empty(shape, item.value().options());
      exp_avg_sq = at::empty(shape, item.value().options());
    }
    if (placement_.pipeline) {
      broadcast_from(owner, exp_avg);
      broadcast_from(owner, exp_avg_sq);
    }
    if (model_->tensor_parallel() != nullptr) {  // this rank's slices, unsplit over the group
      exp_avg = model_->unshard(item.key(), exp_avg);
      exp_avg_sq = model_->unshard(item.key(), exp_avg_sq);
    }
    take(header, exp_avg, exp_avg_sq);
  }
  state_->forget_gathered();
}

OptimizerState LayoutAdamW::state() {
  OptimizerState full;
  for_each_moment(headers(), [&](const Header& header, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
    full[header.name] = {header.step, exp_avg.to(torch::kCPU, torch::kFloat, false, /*copy=*/true),
                         exp_avg_sq.to(torch::kCPU, torch::kFloat, false, /*copy=*/true)};
  });
  return full;
}

OptimizerState LayoutAdamW::local_state() {
  if (state_->shard_group() != nullptr || state_->keeps_weights()) {
    throw std::logic_error("local_state: this rank's AdamW state is a shard of its data-parallel group's (ZeRO)");
  }
  OptimizerState local;
  for (size_t i = 0; i < placement_.held.size(); ++i) {
    const std::optional<int64_t> steps = state_->steps_of(i);
    if (!steps) continue;
    const auto [exp_avg, exp_avg_sq] = state_->moments(i);
    local[placement_.held[i].first] = {*steps, exp_avg.clone(), exp_avg_sq.clone()};
  }
  return local;
}

void LayoutAdamW::load_local_state(const OptimizerState& state) {
  if (state_->shard_group() != nullptr || state_->keeps_weights()) {
    throw std::logic_error("load_local_state: this rank's AdamW state is a shard of its data-parallel group's (ZeRO)");
  }
  state_->load(state);
}

void LayoutAdamW::save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) {
  // Streamed: each unsplit tensor goes into its file as it arrives and is let go.
  if (!stream_weights(weights_path, write)) {
    model::write_model_weights(*model_, weights_path, write);  // a collective when the model is split
  }
  if (!write && !collective_state()) return;  // nothing to gather, nothing to write
  const std::vector<Header> stepped = headers();
  std::optional<OptimizerStateWriter> moments;
  if (write) {
    std::vector<OptimizerStateWriter::Parameter> parameters;
    for (const Header& h : stepped) {
      if (h.has_state) parameters.push_back({h.name, h.step, model_->shards().at(h.name).full_shape});
    }
    moments.emplace(optimizer_path, parameters);
  }
  for_each_moment(stepped, [&](const Header&, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
    if (moments) moments->add(exp_avg, exp_avg_sq);
  });
  if (moments) moments->finish();
}

bool LayoutAdamW::stream_weights(const std::string& path, bool write) {
  // From the stages or the chunks, one unsplit tensor at a time; the model's own parameters hold
  // every weight otherwise, and the caller writes them.
  if (!placement_.pipeline && !state_->keeps_weights()) return false;
  std::optional<model::SafetensorsWriter> weights;
  if (write) {
    std::vector<model::SafetensorsEntry> entries;
    for (const auto& item : model_->named_parameters()) {
      entries.push_back({item.key(), item.value().scalar_type(), model_->shards().at(item.key()).full_shape});
    }
    weights.emplace(path, std::move(entries));
  }
  for_each_weight([&](const std::string&, const at::Tensor& weight) {
    if (weights) weights->append(weight);
  });
  if (weights) weights->finish();
  return true;
}

void LayoutAdamW::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
  materialize_others();
  if (state_->keeps_weights()) {
    model_->load_full_state(weights, [&](const std::string& name, const at::Tensor& local) {
      // Another stage's parameter is that stage's to keep (its storage here let go at the next step).
      if (const std::optional<size_t> held = held_index(name)) state_->load_weight(*held, local);
    });
  } else {
    model_->load_full_state(weights);
  }
  OptimizerState mine;
  for (const auto& [name, s] : optimizer) {
    if (!model_->shards().count(name)) {
      throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
    }
    if (!held_index(name)) continue;
    mine[name] = {s.step, model_->shard(name, s.exp_avg), model_->shard(name, s.exp_avg_sq)};
  }
  state_->load(mine);
}

model::NamedTensors LayoutAdamW::unsplit_gradients() {
  if (!placement_.pipeline && state_->shard_group() == nullptr) return model_->full_gradients();
  torch::NoGradGuard no_grad;
  model::NamedTensors out;
  for (const auto& item : model_->named_parameters()) {
    const int owner = owner_of(item.key());
    at::Tensor value = owner == rank() ? state_->gradient(*held_index(item.key())) : at::Tensor();
    if (placement_.pipeline) {
      at::Tensor has = torch::tensor({value.defined() ? 1.0 : 0.0}, torch::kDouble)
                           .to(placement_.pipeline->device.torch_device());
      broadcast_from(owner, has);
      if (has.to(torch::kCPU).item<double>() == 0.0) continue;
      value = value.defined() ? value.detach().clone().contiguous()
                              : at::empty(shape_of(item.key(), item.value()), item.value().options());
      broadcast_from(owner, value);
    } else if (!value.defined()) {
      continue;
    }
    if (model_->tensor_parallel() != nullptr) value = model_->unshard(item.key(), value);
    out.emplace_back(item.key(), value.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous());
  }
  state_->forget_gathered();
  return out;
}

// Every parameter here, in the model's order.
Placement whole_model_placement(model::GPT2LMHeadModelImpl& model) { return {named_parameters_of(model), {}, {}}; }

Placement stage_placement(model::GPT2LMHeadModelImpl& model, PipelineStageParameters stage) {
  if (!stage.pipeline.group) throw std::invalid_argument("stage_adamw: no pipeline group given");
  Placement placement;
  for (const auto& item : model.named_parameters()) {
    if (std::find(stage.held.begin(), stage.held.end(), item.key()) != stage.held.end()) {
      placement.held.emplace_back(item.key(), item.value());
    }
  }
  placement.owner = std::move(stage.owner);
  placement.pipeline = std::move(stage.pipeline);
  placement.post_validate = stage.post_validate;
  return placement;
}

HeldAdamWFactory whole_moments(const OptimizerSettings& settings) {
  return [settings](const NamedParameters& held) -> std::unique_ptr<HeldAdamW> {
    return std::make_unique<WholeMoments>(held, settings);
  };
}

}  // namespace

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

std::unique_ptr<StepOptimizer> replicated_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings) {
  return whole_model_adamw(std::move(model), settings, whole_moments(settings));
}

std::unique_ptr<StepOptimizer> whole_model_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings,
                                                 HeldAdamWFactory state) {
  Placement placement = whole_model_placement(*model);
  return std::make_unique<LayoutAdamW>(std::move(model), settings, std::move(placement), std::move(state));
}

std::unique_ptr<StepOptimizer> stage_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings,
                                           PipelineStageParameters stage, HeldAdamWFactory state) {
  if (!state) state = whole_moments(settings);
  Placement placement = stage_placement(*model, std::move(stage));
  return std::make_unique<LayoutAdamW>(std::move(model), settings, std::move(placement), std::move(state));
}

}  // namespace harness::train
