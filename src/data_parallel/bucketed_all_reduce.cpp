// BucketedAllReduce (see bucketed_all_reduce.h). The hooks sit on the gradient accumulators,
// which this object keeps alive (otherwise autograd would make new ones, without the hooks).
#include "harness/data_parallel/bucketed_all_reduce.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace harness::data_parallel {
namespace {

constexpr size_t kNoBucket = std::numeric_limits<size_t>::max();

struct GradientReadyHook : torch::autograd::FunctionPostHook {
  GradientReadyHook(GradientSynchronizer* owner, size_t index) : owner(owner), index(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    owner->add(index);
    return outputs;
  }
  GradientSynchronizer* owner;
  size_t index;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> all_to_all_even(c10d::Backend& group, at::Tensor& output, at::Tensor& input) {
  std::vector<int64_t> even_splits;
  return group.alltoall_base(output, input, even_splits, even_splits, c10d::AllToAllOptions());
}

std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t> hook_gradient_accumulator(const at::Tensor& parameter,
                                                                                      GradientSynchronizer* owner,
                                                                                      size_t index) {
  auto node = torch::autograd::impl::grad_accumulator(parameter);
  const uintptr_t key = node->add_post_hook(std::make_unique<GradientReadyHook>(owner, index));
  return {std::move(node), key};
}

ChunkOverlap chunk_overlap(int64_t rank, int64_t chunk, int64_t offset, int64_t n) {
  const int64_t begin = rank * chunk, end = begin + chunk;
  const int64_t from = std::max(begin, offset), to = std::min(end, offset + n);
  if (from >= to) return {};
  return {from - begin, from - offset, to - from};
}

std::vector<std::vector<size_t>> plan_buckets(const std::vector<at::Tensor>& parameters,
                                              int64_t cap_bytes) {
  std::vector<std::vector<size_t>> plan;
  int64_t bytes = 0;
  const at::Tensor* previous = nullptr;
  for (size_t k = parameters.size(); k-- > 0;) {
    const at::Tensor& p = parameters[k];
    if (!p.requires_grad()) continue;
    const int64_t size = p.numel() * static_cast<int64_t>(p.element_size());
    const bool same_kind = previous != nullptr && previous->scalar_type() == p.scalar_type() &&
                           previous->device() == p.device();
    if (plan.empty() || !same_kind || bytes + size > cap_bytes) {
      plan.emplace_back();
      bytes = 0;
    }
    plan.back().push_back(k);
    bytes += size;
    previous = &p;
  }
  return plan;
}

std::vector<std::vector<size_t>> keep_apart_in_plan(const std::vector<std::vector<size_t>>& plan,
                                                    const std::vector<size_t>& apart) {
  std::vector<std::vector<size_t>> out;
  for (const std::vector<size_t>& bucket : plan) {
    std::vector<size_t> run;
    for (size_t index : bucket) {
      if (std::find(apart.begin(), apart.end(), index) == apart.end()) {
        run.push_back(index);
        continue;
      }
      if (!run.empty()) out.push_back(std::move(run));
      run.clear();
      out.push_back({index});
    }
    if (!run.empty()) out.push_back(std::move(run));
  }
  return out;
}

BucketedAllReduce::BucketedAllReduce(DistContext ctx, double bucket_cap_mb,
                                     AllReduceAlgorithm allreduce, GradientReduction reduction)
    : ctx_(std::move(ctx)), allreduce_(allreduce), reduction_(reduction) {
  if (reduction_ != GradientReduction::kAllReduce && allreduce_ == AllReduceAlgorithm::kRing) {
    throw std::invalid_argument("--zero_stage 1 reduce-scatters with the process group's collectives: "
                                "it cannot take --allreduce ring");
  }
  if (!(bucket_cap_mb > 0.0)) {
    throw std::invalid_argument("--bucket_cap_mb " + std::to_string(bucket_cap_mb) +
                                " must be positive");
  }
  cap_bytes_ = static_cast<int64_t>(bucket_cap_mb * 1024.0 * 1024.0);
  if (allreduce_ == AllReduceAlgorithm::kRing) ring_ = std::make_unique<RingAllReduceThread>(ctx_);
}

BucketedAllReduce::~BucketedAllReduce() {
  for (auto& [node, key] : hooks_) node->del_post_hook(key);
  for (auto& bucket : buckets_) {
    if (bucket.work) {
      try {
        bucket.work->wait();
      } catch (...) {  // a destructor must not throw; the failure was reported to finalize()
      }
    }
  }
}

void BucketedAllReduce::attach(std::vector<at::Tensor> parameters) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!parameters_.empty()) throw std::logic_error("BucketedAllReduce::attach called twice");
  parameters_ = std::move(parameters);
  std::vector<size_t> apart;
  for (const at::Tensor& p : apart_) {
    auto it = std::find_if(parameters_.begin(), parameters_.end(), [&](const at::Tensor& q) { return q.is_same(p); });
    if (it == parameters_.end()) throw std::invalid_argument("BucketedAllReduce::keep_apart: a parameter not attached");
    apart.push_back(static_cast<size_t>(it - parameters_.begin()));
  }
  plan_ = keep_apart_in_plan(plan_buckets(parameters_, cap_bytes_), apart);
  bucket_of_.assign(parameters_.size(), kNoBucket);
  ready_.assign(parameters_.size(), 0);
  fired_.assign(parameters_.size(), 0);
  had_gradient_.assign(parameters_.size(), 0);
  accumulated_.assign(parameters_.size(), 0);
  buckets_.resize(plan_.size());
  for (size_t b = 0; b < plan_.size(); ++b) {
    buckets_[b].params = plan_[b];
    buckets_[b].pending = plan_[b].size();
    for (size_t index : plan_[b]) bucket_of_[index] = b;
  }
  for (size_t index = 0; index < parameters_.size(); ++index) {
    if (bucket_of_[index] == kNoBucket) continue;
    const at::Tensor& p = parameters_[index];
    if (!p.is_leaf()) {
      throw std::invalid_argument("BucketedAllReduce: parameter " + std::to_string(index) +
                                  " is not a leaf tensor");
    }
    hooks_.push_back(hook_gradient_accumulator(p, this, index));
  }
}

void BucketedAllReduce::add(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (index >= bucket_of_.size() || bucket_of_[index] == kNoBucket) return;
  if (no_sync_) {  // a micro-step that only accumulates; finalize() follows a later backward
    fired_[index] = 1;  // used in this optimizer step: not presumed unused in the next
    return;
  }
  Bucket& bucket = buckets_[bucket_of_[index]];
  fired_[index] = 1;
  if (ready_[index]) {  // accumulated again (another backward), or presumed unused after all
    if (bucket.launched) bucket.stale = true;
    return;
  }
  // Complete only at its last expected accumulation (a schedule's last micro-batch backward); a
  // parameter that gets fewer is reduced in finalize(), one that gets more makes its bucket stale.
  if (++accumulated_[index] < expected_accumulations_) return;
  ready_[index] = 1;
  if (--bucket.pending == 0) launch_ready_buckets_locked();
}

int64_t BucketedAllReduce::launched_in_step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return launched_in_step_;
}

void BucketedAllReduce::launch_ready_buckets_locked() {
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
    launch_locked(buckets_[next_to_launch_]);
    ++launched_in_step_;
    ++next_to_launch_;
  }
}

void BucketedAllReduce::launch_locked(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> pieces;
  pieces.reserve(bucket.params.size());
  for (size_t index : bucket.params) {
    const at::Tensor& p = parameters_[index];
    const at::Tensor& g = p.grad();
    pieces.push_back(g.defined() ? g.reshape({-1}) : torch::zeros({p.numel()}, p.options()));
  }
  bucket.buffer = torch::cat(pieces);
  pieces.clear();
  if (reduce_dtype_ && *reduce_dtype_ != bucket.buffer.scalar_type()) bucket.buffer = bucket.buffer.to(*reduce_dtype_);
  communicated_bytes_ += bucket.buffer.numel() * static_cast<int64_t>(bucket.buffer.element_size());
  if (reduction_ == GradientReduction::kShardedGradients) {
    // ZeRO-2: the bucket holds the gradients now; a later accumulation starts a new .grad() (its
    // bucket, stale, is reduced again and added to the chunk).
    for (size_t index : bucket.params) {
      at::Tensor& g = parameters_[index].mutable_grad();
      if (g.defined()) had_gradient_[index] = 1;
      g = at::Tensor();
    }
  }
  if (scatters()) {
    const int64_t n = bucket.buffer.numel(), chunk = (n + ctx_.world_size - 1) / ctx_.world_size;
    if (chunk * ctx_.world_size > n) {
      bucket.buffer = torch::cat({bucket.buffer, torch::zeros({chunk * ctx_.world_size - n}, bucket.buffer.options())});
    }
    if (ctx_.backend == Backend::kGloo) {
      // Gloo's reduce-scatter all-reduces a copy of the whole buffer and keeps a slice: twice the
      // bytes of a reduce-scatter, and with the parameter all-gather 1.5x an all-reduce's. An
      // all-to-all hands each rank every rank's copy of its chunk ((N-1)/N of the buffer sent, as
      // a ring reduce-scatter), summed in finalize().
      bucket.received = torch::empty_like(bucket.buffer);
      bucket.work = all_to_all_even(*ctx_.group, bucket.received, bucket.buffer);
    } else {
      bucket.scattered = torch::empty({chunk}, bucket.buffer.options());
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      bucket.work = ctx_.group->_reduce_scatter_base(bucket.scattered, bucket.buffer, options);
    }
  } else if (ring_) {
    bucket.work = ring_->all_reduce_async(bucket.buffer, ReduceKind::kSum);
  } else {
    std::vector<at::Tensor> tensors{bucket.buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    bucket.work = ctx_.group->allreduce(tensors, options);
  }
  bucket.launched = true;
  bucket.stale = false;
  bucket.settled = false;
  if (reduction_ == GradientReduction::kShardedGradients) {
    // The earlier buckets whose reduce-scatter is done let their buffers go now, so that what a
    // rank holds of the full gradients is the buckets still in flight.
    for (Bucket& other : buckets_) {
      if (&other != &bucket && other.work && !other.settled && other.work->isCompleted()) settle_locked(other);
    }
  }
}

void BucketedAllReduce::settle_locked(Bucket& bucket) {
  if (bucket.settled || !bucket.work) return;
  bucket.work->wait();
  torch::NoGradGuard no_grad;
  const at::ScalarType dtype = parameters_[bucket.params.front()].scalar_type();
  at::Tensor average;
  if (bucket.received.defined()) {  // the all-to-all: this rank's chunk from every rank, summed
    // in rank order into rank 0's copy (converted first if the reduction ran in another dtype):
    // one pass per rank, faster than a sum over dim 0.
    const at::Tensor copies = bucket.received.view({ctx_.world_size, -1});
    average = copies[0].to(dtype, /*non_blocking=*/false, /*copy=*/true);
    for (int64_t r = 1; r < ctx_.world_size; ++r) average.add_(copies[r]);
  } else {
    average = bucket.scattered.to(dtype);
  }
  average.div_(static_cast<double>(ctx_.world_size));
  if (reduction_ == GradientReduction::kShardedGradients && bucket.shard.defined()) {
    bucket.shard.add_(average);
  } else {
    bucket.shard = average;
  }
  bucket.buffer = at::Tensor();
  bucket.scattered = at::Tensor();
  bucket.received = at::Tensor();
  bucket.settled = true;
}

void BucketedAllReduce::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(ctx_.group, "BucketedAllReduce: the DistContext has no process group");
  launched_during_backward_ = launched_in_step_;
  // Every rank issues the same sequence: the buckets not yet launched, in bucket order; then,
  // once they are all done, one agreement (below); then the buckets some rank saw change again.
  for (; next_to_launch_ < buckets_.size(); ++next_to_launch_) launch_locked(buckets_[next_to_launch_]);
  for (auto& bucket : buckets_) {
    if (!bucket.settled) bucket.work->wait();
  }

  // What each rank decided alone, agreed by a MAX all-reduce of one flag per bucket ("a gradient
  // changed after its launch here") and one per parameter ("it has a gradient here"), as DDP does
  // with find_unused_parameters: a bucket stale on one rank is reduced again on all of them, and a
  // parameter that got a gradient on any rank gets the average on every rank (a rank that did not
  // use it contributed zeros), so that ranks never issue different collectives nor step different
  // parameters.
  const size_t n_buckets = buckets_.size();
  at::Tensor flags = torch::zeros({static_cast<int64_t>(n_buckets + parameters_.size())}, torch::kInt);
  {
    auto f = flags.accessor<int, 1>();
    for (size_t b = 0; b < n_buckets; ++b) f[static_cast<int64_t>(b)] = buckets_[b].stale ? 1 : 0;
    for (size_t i = 0; i < parameters_.size(); ++i) {
      f[static_cast<int64_t>(n_buckets + i)] = parameters_[i].grad().defined() || had_gradient_[i] ? 1 : 0;
    }
  }
  communicated_bytes_ += flags.numel() * static_cast<int64_t>(flags.element_size());
  std::vector<at::Tensor> agreement{flags.to(ctx_.device.torch_device())};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  ctx_.group->allreduce(agreement, max)->wait();
  flags = agreement[0].to(torch::kCPU);
  const auto agreed = flags.accessor<int, 1>();
  for (size_t b = 0; b < n_buckets; ++b) {
    if (agreed[static_cast<int64_t>(b)] == 0) continue;
    if (scatters()) settle_locked(buckets_[b]);  // ZeRO-2 adds the late gradients' reduction to it
    launch_locked(buckets_[b]);
    buckets_[b].work->wait();
  }
  torch::NoGradGuard no_grad;
  if (scatters()) {
    const std::string stage = reduction_ == GradientReduction::kShardedGradients ? "2" : "1";
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (bucket_of_[i] != kNoBucket && agreed[static_cast<int64_t>(n_buckets + i)] == 0) {
        reset_step_locked();
        throw std::runtime_error("--zero_stage " + stage + ": parameter " + std::to_string(i) +
                                 " got no gradient on any rank this step; a sharded AdamW step needs every "
                                 "parameter's (use --zero_stage 0 for a model with unused parameters)");
      }
    }
    for (auto& bucket : buckets_) settle_locked(bucket);
    reset_step_locked();
    ++finalized_steps_;
    return;
  }
  for (auto& bucket : buckets_) {
    // The average in the parameters' dtype (a bf16-reduced sum is rounded once, not twice).
    const at::ScalarType dtype = parameters_[bucket.params.front()].scalar_type();
    if (bucket.buffer.scalar_type() != dtype) bucket.buffer = bucket.buffer.to(dtype);
    bucket.buffer.div_(static_cast<double>(ctx_.world_size));
    int64_t offset = 0;
    for (size_t index : bucket.params) {
      at::Tensor& p = parameters_[index];
      const int64_t n = p.numel();
      at::Tensor& g = p.mutable_grad();
      if (!g.defined() && agreed[static_cast<int64_t>(n_buckets + index)] != 0) g = torch::zeros_like(p);
      if (g.defined()) g.copy_(bucket.buffer.slice(0, offset, offset + n).view_as(g));
      offset += n;
    }
  }
  reset_step_locked();
  ++finalized_steps_;
}

int64_t BucketedAllReduce::bucket_elements(size_t b) const {
  int64_t n = 0;
  for (size_t index : plan_.at(b)) n += parameters_[index].numel();
  return n;
}

int64_t BucketedAllReduce::chunk_elements(size_t b) const {
  return (bucket_elements(b) + ctx_.world_size - 1) / ctx_.world_size;
}

const at::Tensor& BucketedAllReduce::gradient_shard(size_t b) const {
  const at::Tensor& shard = buckets_.at(b).shard;
  if (!scatters() || !shard.defined()) {
    throw std::logic_error("BucketedAllReduce::gradient_shard: no reduce-scattered step has been finalized");
  }
  return shard;
}

void BucketedAllReduce::discard_shards() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Bucket& bucket : buckets_) bucket.shard = at::Tensor();
}

void BucketedAllReduce::keep_apart(const at::Tensor& parameter) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!parameters_.empty()) throw std::logic_error("BucketedAllReduce::keep_apart called after attach");
  apart_.push_back(parameter);
}

const at::Tensor& BucketedAllReduce::gradient_shard_of(const at::Tensor& parameter) const {
  for (size_t b = 0; b < plan_.size(); ++b) {
    if (plan_[b].size() == 1 && parameters_.at(plan_[b].front()).is_same(parameter)) return gradient_shard(b);
  }
  throw std::logic_error("BucketedAllReduce::gradient_shard_of: the parameter was not kept apart");
}

std::vector<at::Tensor> BucketedAllReduce::gather_bucket(size_t b, const at::Tensor& chunk) const {
  BucketGather gather = start_gather(b, chunk);
  return finish_gather(gather);
}

BucketedAllReduce::BucketGather BucketedAllReduce::start_gather(size_t b, const at::Tensor& chunk) const {
  at::Tensor mine = chunk.contiguous();
  BucketGather gather;
  gather.bucket = b;
  gather.all = torch::empty({mine.numel() * ctx_.world_size}, mine.options());
  if (ctx_.backend == Backend::kGloo) {
    // Gloo's all-gather took 7-16 ms for 7 MB per rank between two CPU processes here, an
    // all-to-all of the same bytes 4-6 ms: every rank sends its chunk to every rank as one.
    gather.send = mine.repeat({ctx_.world_size});
    gather.work = all_to_all_even(*ctx_.group, gather.all, gather.send);
  } else {
    gather.work = ctx_.group->_allgather_base(gather.all, mine);
  }
  return gather;
}

std::vector<at::Tensor> BucketedAllReduce::finish_gather(BucketGather& gather) const {
  gather.work->wait();
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (size_t index : plan_.at(gather.bucket)) {
    const at::Tensor& p = parameters_[index];
    parts.push_back(gather.all.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  return parts;
}

void BucketedAllReduce::reset_step_locked() {
  // Parameters that got no gradient this step (unused by the forward) are taken as ready from
  // the start of the next one, so that they do not hold their bucket, and every bucket after it,
  // back until finalize(). Should one get a gradient after all, its bucket is reduced again in
  // finalize() (the stale path), so the result stays right either way.
  const bool had_backward = std::any_of(fired_.begin(), fired_.end(), [](char f) { return f != 0; });
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    bucket.launched = false;
    bucket.stale = false;
    bucket.settled = false;
    bucket.buffer = at::Tensor();
    bucket.scattered = at::Tensor();
    bucket.received = at::Tensor();
    bucket.work.reset();
  }
  for (size_t index = 0; index < ready_.size(); ++index) {
    if (bucket_of_[index] == kNoBucket) continue;
    const bool unused = had_backward ? fired_[index] == 0 : ready_[index] != 0;
    ready_[index] = unused ? 1 : 0;
    if (unused) --buckets_[bucket_of_[index]].pending;
  }
  std::fill(fired_.begin(), fired_.end(), 0);
  std::fill(had_gradient_.begin(), had_gradient_.end(), 0);
  std::fill(accumulated_.begin(), accumulated_.end(), 0);
  next_to_launch_ = 0;
  launched_in_step_ = 0;
}

}  // namespace harness::data_parallel
