// The optimizer parts of a training step (see step_optimizer.h).
#include "harness/train/step_optimizer.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/process_group.h"
#include "harness/data_parallel/zero.h"
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

void scale_in_place(const std::vector<at::Tensor>& tensors, double factor) {
  torch::NoGradGuard no_grad;
  for (const at::Tensor& t : tensors) t.mul_(factor);
}

// The gradients `model` holds now (parameters without one left out).
std::vector<at::Tensor> gradients_of(model::GPT2LMHeadModelImpl& model) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : model.parameters()) {
    if (p.grad().defined()) out.push_back(p.grad());
  }
  return out;
}

torch::optim::AdamWOptions adamw_options(const OptimizerSettings& settings) {
  return torch::optim::AdamWOptions(settings.learning_rate).weight_decay(settings.weight_decay);
}

// The squares of the gradients of `model`'s parameters that `counted` names, summed as one device
// would: split over a tensor-parallel group, a split parameter's gradient is the group's slices
// together, so their squares are summed over the group (a collective), and a replicated one is the
// same on every rank, so it is counted once.
double gradient_squares(model::GPT2LMHeadModelImpl& model, const std::function<bool(const std::string&)>& counted) {
  model::TensorParallelGroup* group = model.tensor_parallel();
  std::vector<at::Tensor> split, replicated;
  for (const auto& item : model.named_parameters()) {
    if (!item.value().grad().defined() || !counted(item.key())) continue;
    const bool is_split =
        group != nullptr && model.shards().at(item.key()).spec.kind != model::ShardSpec::Kind::kReplicated;
    (is_split ? split : replicated).push_back(item.value().grad());
  }
  if (group == nullptr) return sum_of_squares(replicated);
  const at::Tensor mine = torch::tensor({sum_of_squares(split)}, torch::kDouble).to(model.first_device().torch_device());
  double split_squares = 0.0;
  for (const at::Tensor& part : group->all_gather(mine)) split_squares += part.to(torch::kCPU).item<double>();
  return split_squares + sum_of_squares(replicated);
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

// AdamW on the parameters this rank holds: the whole model, or its slices of a split one (each
// rank steps its shards; the state is gathered unsplit for checkpoints).
class ReplicatedAdamW final : public StepOptimizer {
 public:
  ReplicatedAdamW(model::GPT2LMHeadModel model, const OptimizerSettings& settings)
      : model_(std::move(model)),
        settings_(settings),
        optimizer_(std::make_unique<optim::FusedAdamW>(model_->parameters(), adamw_options(settings))) {}

  void zero_grad() override { optimizer_->zero_grad(); }
  void step() override;
  void set_learning_rate(double learning_rate) override { set_adamw_learning_rate(*optimizer_, learning_rate); }
  double learning_rate() const override { return adamw_learning_rate(*optimizer_); }
  bool collective_state() const override { return model_->tensor_parallel() != nullptr; }

  OptimizerState state() override;
  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override;
  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override;
  model::NamedTensors unsplit_gradients() override { return model_->full_gradients(); }

  int64_t state_bytes() const override { return adamw_state_bytes(*optimizer_); }

 private:
  model::GPT2LMHeadModel model_;
  OptimizerSettings settings_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

// ZeRO-1: AdamW's moments for this rank's chunks of every gradient bucket (data_parallel/zero.h).
class ShardedAdamWOptimizer final : public StepOptimizer {
 public:
  ShardedAdamWOptimizer(model::GPT2LMHeadModel model, const OptimizerSettings& settings,
                        data_parallel::BucketedAllReduce& gradients)
      : model_(std::move(model)), settings_(settings), gradients_(gradients) {
    gradients_.attach(*model_);
    data_parallel::AdamWHyperparameters options;
    options.lr = settings.learning_rate;
    options.weight_decay = settings.weight_decay;
    adam_ = std::make_unique<data_parallel::ShardedAdamW>(gradients_, model_->parameters(), options);
  }

  void zero_grad() override {
    for (auto& p : model_->parameters()) p.mutable_grad() = at::Tensor();
  }
  void step() override;
  void set_learning_rate(double learning_rate) override { adam_->set_learning_rate(learning_rate); }
  double learning_rate() const override { return adam_->learning_rate(); }
  bool collective_state() const override { return true; }

  OptimizerState state() override;

  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override {
    model::write_model_weights(*model_, weights_path, write);
    const OptimizerState optimizer = state();  // collective: every rank gathers
    if (write) write_optimizer_state(optimizer_path, optimizer);
  }

  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override;
  model::NamedTensors unsplit_gradients() override;
  int64_t state_bytes() const override { return adam_->state_bytes(); }

 private:
  model::GPT2LMHeadModel model_;
  OptimizerSettings settings_;
  data_parallel::BucketedAllReduce& gradients_;
  std::unique_ptr<data_parallel::ShardedAdamW> adam_;
};

void ReplicatedAdamW::step() {
  const std::vector<at::Tensor> gradients = gradients_of(*model_);
  last_grad_norm_ = std::sqrt(gradient_squares(*model_, [](const std::string&) { return true; }));
  const double coefficient = clip_coefficient(last_grad_norm_, settings_.max_grad_norm);
  if (coefficient < 1.0) scale_in_place(gradients, coefficient);
  optimizer_->step();
}

OptimizerState ReplicatedAdamW::state() {
  OptimizerState state = capture_adamw_state(*optimizer_, named_parameters_of(*model_));
  if (model_->tensor_parallel() == nullptr) return state;
  // Every rank of the group walks the parameters in the same order and has state for the same
  // ones (all train every parameter), so the gathers match across the group.
  OptimizerState full;
  for (const auto& item : model_->named_parameters()) {
    auto it = state.find(item.key());
    if (it == state.end()) continue;
    full[item.key()] = {it->second.step, model_->unshard(item.key(), it->second.exp_avg),
                        model_->unshard(item.key(), it->second.exp_avg_sq)};
  }
  return full;
}

void ReplicatedAdamW::save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) {
  model::write_model_weights(*model_, weights_path, write);  // a collective when the model is split
  if (model_->tensor_parallel() == nullptr) {
    if (write) write_optimizer_state(optimizer_path, state());
    return;
  }
  // Split: each unsplit moment is gathered (a collective over the group), written by the writer
  // and dropped before the next; every rank walks the same parameters in the same order.
  std::vector<std::pair<std::string, const torch::optim::AdamWParamState*>> with_state;
  std::vector<OptimizerStateWriter::Parameter> parameters;
  auto& states = optimizer_->state();
  for (const auto& item : model_->named_parameters()) {
    auto it = states.find(item.value().unsafeGetTensorImpl());
    if (it == states.end()) continue;
    const auto* s = static_cast<const torch::optim::AdamWParamState*>(it->second.get());
    with_state.emplace_back(item.key(), s);
    parameters.push_back({item.key(), s->step(), model_->shards().at(item.key()).full_shape});
  }
  std::optional<OptimizerStateWriter> file;
  if (write) file.emplace(optimizer_path, parameters);
  for (const auto& [name, s] : with_state) {
    const at::Tensor exp_avg = model_->unshard(name, s->exp_avg()), exp_avg_sq = model_->unshard(name, s->exp_avg_sq());
    if (file) file->add(exp_avg, exp_avg_sq);
  }
  if (file) file->finish();
}

void ReplicatedAdamW::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
  model_->load_full_state(weights);
  OptimizerState local;
  for (const auto& [name, s] : optimizer) {
    if (!model_->shards().count(name)) {
      throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
    }
    local[name] = {s.step, model_->shard(name, s.exp_avg), model_->shard(name, s.exp_avg_sq)};
  }
  restore_adamw_state(*optimizer_, named_parameters_of(*model_), local);
}

void ShardedAdamWOptimizer::step() {
  // Every rank holds its chunk of each bucket's averaged gradient (the bucket's parameters
  // flattened in plan order, zeros past its end): the squares of all chunks, summed over the
  // data-parallel ranks, are the whole gradient's. Each parameter's part of a chunk is normed on
  // its own, as clip_grad_norm_ norms each gradient (one fp32 norm over a whole bucket rounds
  // several times more).
  const data_parallel::DistContext& ctx = gradients_.context();
  const std::vector<at::Tensor> parameters = model_->parameters();
  const auto& plan = gradients_.bucket_plan();
  std::vector<at::Tensor> chunks, pieces;
  for (size_t b = 0; b < plan.size(); ++b) {
    const at::Tensor& chunk = gradients_.gradient_shard(b);
    chunks.push_back(chunk);
    const int64_t begin = ctx.rank * gradients_.chunk_elements(b), end = begin + gradients_.chunk_elements(b);
    int64_t offset = 0;
    for (size_t index : plan[b]) {
      const int64_t n = parameters.at(index).numel();
      const int64_t from = std::max(begin, offset), to = std::min(end, offset + n);
      if (from < to) pieces.push_back(chunk.narrow(0, from - begin, to - from));
      offset += n;
    }
  }
  std::vector<at::Tensor> squares{torch::tensor({sum_of_squares(pieces)}, torch::kDouble).to(ctx.device.torch_device())};
  if (ctx.world_size > 1) ctx.group->allreduce(squares)->wait();
  last_grad_norm_ = std::sqrt(squares[0].to(torch::kCPU).item<double>());
  const double coefficient = clip_coefficient(last_grad_norm_, settings_.max_grad_norm);
  if (coefficient < 1.0) scale_in_place(chunks, coefficient);
  adam_->step();
}

OptimizerState ShardedAdamWOptimizer::state() {
  const data_parallel::ShardedAdamW::FullState full = adam_->gather_state();  // collective
  OptimizerState out;
  if (full.moments.empty()) return out;
  const NamedParameters named = named_parameters_of(*model_);
  for (size_t i = 0; i < named.size(); ++i) {
    if (!full.moments[i].first.defined()) continue;
    out[named[i].first] = {full.step, full.moments[i].first.to(torch::kFloat), full.moments[i].second.to(torch::kFloat)};
  }
  return out;
}

void ShardedAdamWOptimizer::load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) {
  model_->load_full_state(weights);
  const NamedParameters named = named_parameters_of(*model_);
  data_parallel::ShardedAdamW::FullState full;
  if (!optimizer.empty()) {
    std::map<std::string, size_t> index_of;
    for (size_t i = 0; i < named.size(); ++i) index_of[named[i].first] = i;
    full.moments.resize(named.size());
    full.step = optimizer.begin()->second.step;
    // Every entry is checked on every rank (not only the chunks this rank keeps), so that a bad
    // checkpoint fails on all ranks alike instead of leaving some to wait.
    for (const auto& [name, state] : optimizer) {
      auto it = index_of.find(name);
      if (it == index_of.end()) throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
      if (state.step != full.step) {
        throw std::invalid_argument("optimizer state: " + name + " took " + std::to_string(state.step) +
                                    " steps, other parameters " + std::to_string(full.step) +
                                    "; --zero_stage 1 steps every parameter together");
      }
      for (const at::Tensor* moment : {&state.exp_avg, &state.exp_avg_sq}) {
        if (!moment->defined() || moment->sizes() != named[it->second].second.sizes()) {
          throw std::invalid_argument("optimizer state of " + name + " does not have the parameter's shape");
        }
      }
      full.moments[it->second] = {state.exp_avg, state.exp_avg_sq};
    }
    for (size_t i = 0; i < named.size(); ++i) {
      if (named[i].second.requires_grad() && !full.moments[i].first.defined()) {
        throw std::invalid_argument("optimizer state: none for " + named[i].first + ", which --zero_stage 1 steps");
      }
    }
  }
  adam_->load_state(full);
}

model::NamedTensors ShardedAdamWOptimizer::unsplit_gradients() {
  // The averaged gradient exists only as the ranks' chunks: all-gathered here (collective).
  torch::NoGradGuard no_grad;
  const NamedParameters named = named_parameters_of(*model_);
  std::vector<at::Tensor> full(named.size());
  const auto& plan = gradients_.bucket_plan();
  for (size_t b = 0; b < plan.size(); ++b) {
    const std::vector<at::Tensor> parts = gradients_.gather_bucket(b, gradients_.gradient_shard(b));
    for (size_t k = 0; k < parts.size(); ++k) full[plan[b][k]] = parts[k].to(torch::kCPU).contiguous();
  }
  model::NamedTensors out;
  for (size_t i = 0; i < named.size(); ++i) {
    if (full[i].defined()) out.emplace_back(named[i].first, full[i]);
  }
  return out;
}


// Pipeline stages that are processes: AdamW on the parameters this rank's stages hold (its slices
// of them when the stage is split over a tensor-parallel group). The other weights of the model
// are kept as loaded until gather_weights() brings them up to date from the stages that own them;
// checkpoints, gradients and the norm are gathered over the pipeline group, then unsplit over the
// tensor-parallel one.
class StageAdamW final : public StepOptimizer {
 public:
  StageAdamW(model::GPT2LMHeadModel model, const OptimizerSettings& settings, PipelineStageParameters stage)
      : model_(std::move(model)), settings_(settings), stage_(std::move(stage)) {
    if (!stage_.pipeline.group) throw std::invalid_argument("stage_adamw: no pipeline group given");
    std::vector<at::Tensor> held;
    for (const auto& item : model_->named_parameters()) {
      if (!stage_.owner.count(item.key())) {
        throw std::invalid_argument("stage_adamw: no stage owns " + item.key());
      }
      if (std::find(stage_.held.begin(), stage_.held.end(), item.key()) != stage_.held.end()) {
        held.push_back(item.value());
        held_named_.emplace_back(item.key(), item.value());
      } else {
        others_.push_back({item.key(), item.value(), item.value().sizes().vec()});
      }
    }
    optimizer_ = std::make_unique<optim::FusedAdamW>(held, adamw_options(settings));
    release_others();
  }

  // A step needs only this rank's stages: the others' weights, brought here for an evaluation or
  // a checkpoint, are let go again.
  void zero_grad() override {
    release_others();
    optimizer_->zero_grad();
  }
  void step() override;
  void set_learning_rate(double learning_rate) override { set_adamw_learning_rate(*optimizer_, learning_rate); }
  double learning_rate() const override { return adamw_learning_rate(*optimizer_); }
  bool collective_state() const override { return true; }
  OptimizerState state() override;
  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override;
  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override {
    materialize_others();
    model_->load_full_state(weights);
    OptimizerState mine;
    for (const auto& [name, s] : optimizer) {
      if (!stage_.owner.count(name)) throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
      if (std::find(stage_.held.begin(), stage_.held.end(), name) == stage_.held.end()) continue;
      mine[name] = {s.step, model_->shard(name, s.exp_avg), model_->shard(name, s.exp_avg_sq)};
    }
    restore_adamw_state(*optimizer_, held_named_, mine);
  }
  model::NamedTensors unsplit_gradients() override;
  int64_t state_bytes() const override { return adamw_state_bytes(*optimizer_); }
  void gather_weights() override;

 private:
  // Broadcasts `tensor` (this rank's copy, overwritten) from pipeline rank `root`.
  void broadcast_from(int root, at::Tensor& tensor) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    stage_.pipeline.group->broadcast(tensors, options)->wait();
  }
  int rank() const { return stage_.pipeline.rank; }

  // Whether each parameter has AdamW state, and its step, as its owner says (a collective over
  // the pipeline group, in the model's order).
  struct Header {
    std::string name;
    bool has_state = false;
    int64_t step = 0;
  };
  std::vector<Header> state_headers();
  // Each parameter's weight (or, with `headers`, each stepped parameter's two moments) from its
  // owner, unsplit over the tensor-parallel group, handed to `take` one at a time and then let go:
  // no rank ever holds more than one unsplit tensor (or pair) of the others' stages.
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
  PipelineStageParameters stage_;
  NamedParameters held_named_;
  std::vector<Other> others_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

void StageAdamW::step() {
  // The squares of the gradients each stage owns (wte once, on the first stage, whose gradient
  // already holds the head's), summed over the stages; split over a tensor-parallel group, a split
  // gradient's squares are summed over the group and a replicated one's counted once.
  std::vector<at::Tensor> held;
  for (const auto& [name, p] : held_named_) {
    if (p.grad().defined()) held.push_back(p.grad());
  }
  const double stage_squares =
      gradient_squares(*model_, [this](const std::string& name) { return stage_.owner.at(name) == rank(); });
  std::vector<at::Tensor> squares{
      torch::tensor({stage_squares}, torch::kDouble).to(stage_.pipeline.device.torch_device())};
  stage_.pipeline.group->allreduce(squares)->wait();
  last_grad_norm_ = std::sqrt(squares[0].to(torch::kCPU).item<double>());
  const double coefficient = clip_coefficient(last_grad_norm_, settings_.max_grad_norm);
  if (coefficient < 1.0) scale_in_place(held, coefficient);
  optimizer_->step();
}

void StageAdamW::gather_weights() {
  materialize_others();
  torch::NoGradGuard no_grad;
  for (const auto& item : model_->named_parameters()) {
    at::Tensor weight = item.value();
    broadcast_from(stage_.owner.at(item.key()), weight);
  }
}

std::vector<StageAdamW::Header> StageAdamW::state_headers() {
  const c10::Device device = stage_.pipeline.device.torch_device();
  auto& states = optimizer_->state();
  std::vector<Header> headers;
  for (const auto& item : model_->named_parameters()) {
    const int owner = stage_.owner.at(item.key());
    at::Tensor header = torch::zeros({2}, torch::kDouble);
    auto it = owner == rank() ? states.find(item.value().unsafeGetTensorImpl()) : states.end();
    if (it != states.end()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      header = torch::tensor({1.0, static_cast<double>(s.step())}, torch::kDouble);
    }
    header = header.to(device);
    broadcast_from(owner, header);
    header = header.to(torch::kCPU);
    headers.push_back({item.key(), header[0].item<double>() != 0.0, static_cast<int64_t>(header[1].item<double>())});
  }
  return headers;
}

void StageAdamW::for_each_weight(const std::function<void(const std::string&, const at::Tensor&)>& take) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model_->named_parameters()) {
    const int owner = stage_.owner.at(item.key());
    at::Tensor weight = owner == rank() ? item.value().detach().contiguous()
                                        : at::empty(shape_of(item.key(), item.value()), item.value().options());
    broadcast_from(owner, weight);
    if (model_->tensor_parallel() != nullptr) weight = model_->unshard(item.key(), weight);
    take(item.key(), weight);
  }
}

void StageAdamW::for_each_moment(const std::vector<Header>& headers,
                                 const std::function<void(const Header&, const at::Tensor&, const at::Tensor&)>& take) {
  const c10::Device device = stage_.pipeline.device.torch_device();
  auto& states = optimizer_->state();
  size_t k = 0;
  for (const auto& item : model_->named_parameters()) {
    const Header& header = headers.at(k++);
    if (!header.has_state) continue;
    const int owner = stage_.owner.at(item.key());
    const std::vector<int64_t> shape = shape_of(item.key(), item.value());
    at::Tensor exp_avg, exp_avg_sq;
    if (owner == rank()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(
          *states.at(item.value().unsafeGetTensorImpl()));
      exp_avg = s.exp_avg().to(device, item.value().scalar_type()).contiguous();
      exp_avg_sq = s.exp_avg_sq().to(device, item.value().scalar_type()).contiguous();
    } else {
      exp_avg = at::empty(shape, item.value().options());
      exp_avg_sq = at::empty(shape, item.value().options());
    }
    broadcast_from(owner, exp_avg);
    broadcast_from(owner, exp_avg_sq);
    if (model_->tensor_parallel() != nullptr) {  // this rank's slices, unsplit over the group
      exp_avg = model_->unshard(item.key(), exp_avg);
      exp_avg_sq = model_->unshard(item.key(), exp_avg_sq);
    }
    take(header, exp_avg, exp_avg_sq);
  }
}

OptimizerState StageAdamW::state() {
  OptimizerState full;
  for_each_moment(state_headers(), [&](const Header& header, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
    full[header.name] = {header.step, exp_avg.to(torch::kCPU), exp_avg_sq.to(torch::kCPU)};
  });
  return full;
}

void StageAdamW::save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) {
  // Streamed: each unsplit tensor goes into its file as it arrives and is let go.
  std::optional<model::SafetensorsWriter> weights;
  if (write) {
    std::vector<model::SafetensorsEntry> entries;
    for (const auto& item : model_->named_parameters()) {
      entries.push_back({item.key(), item.value().scalar_type(), model_->shards().at(item.key()).full_shape});
    }
    weights.emplace(weights_path, std::move(entries));
  }
  for_each_weight([&](const std::string&, const at::Tensor& weight) {
    if (weights) weights->append(weight);
  });
  if (weights) weights->finish();

  const std::vector<Header> headers = state_headers();
  std::optional<OptimizerStateWriter> moments;
  if (write) {
    std::vector<OptimizerStateWriter::Parameter> parameters;
    for (const Header& h : headers) {
      if (h.has_state) parameters.push_back({h.name, h.step, model_->shards().at(h.name).full_shape});
    }
    moments.emplace(optimizer_path, parameters);
  }
  for_each_moment(headers, [&](const Header&, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
    if (moments) moments->add(exp_avg, exp_avg_sq);
  });
  if (moments) moments->finish();
}

model::NamedTensors StageAdamW::unsplit_gradients() {
  const c10::Device device = stage_.pipeline.device.torch_device();
  model::NamedTensors out;
  for (const auto& item : model_->named_parameters()) {
    const int owner = stage_.owner.at(item.key());
    const at::Tensor& grad = item.value().grad();
    at::Tensor has = torch::tensor({owner == rank() && grad.defined() ? 1.0 : 0.0}, torch::kDouble).to(device);
    broadcast_from(owner, has);
    if (has.to(torch::kCPU).item<double>() == 0.0) continue;
    at::Tensor value = owner == rank() ? grad.detach().clone().contiguous()
                                       : at::empty(shape_of(item.key(), item.value()), item.value().options());
    broadcast_from(owner, value);
    if (model_->tensor_parallel() != nullptr) value = model_->unshard(item.key(), value);
    out.emplace_back(item.key(), value.to(torch::kCPU));
  }
  return out;
}

}  // namespace

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

std::unique_ptr<StepOptimizer> replicated_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings) {
  return std::make_unique<ReplicatedAdamW>(std::move(model), settings);
}

std::unique_ptr<StepOptimizer> sharded_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings,
                                             data_parallel::BucketedAllReduce& gradients) {
  return std::make_unique<ShardedAdamWOptimizer>(std::move(model), settings, gradients);
}

std::unique_ptr<StepOptimizer> stage_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings,
                                           PipelineStageParameters stage) {
  return std::make_unique<StageAdamW>(std::move(model), settings, std::move(stage));
}

}  // namespace harness::train
