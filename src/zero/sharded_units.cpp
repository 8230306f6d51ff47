// ShardedUnits (see sharded_units.h). A unit's flat layout is its parameters, each flattened, in order,
// zero-padded to world size x chunk; rank r owns [r * chunk, (r + 1) * chunk).
#include "harness/zero/sharded_units.h"

#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/host_memory.h"

namespace harness::zero {

using data_parallel::Backend;
using data_parallel::ChunkOverlap;
using data_parallel::chunk_overlap;

ShardedUnits::ShardedUnits(DistContext ctx, std::vector<ShardedUnit> units) : ctx_(std::move(ctx)) {
  torch::NoGradGuard no_grad;
  const int64_t N = ctx_.world_size;
  units_.resize(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    Unit& unit = units_[u];
    unit.spec = std::move(units[u]);
    const auto& ps = unit.spec.parameters;
    if (ps.empty() || ps.size() != unit.spec.names.size() || ps.size() != unit.spec.accumulations.size()) {
      throw std::invalid_argument("--zero_stage 3: unit " + unit.spec.name + " is not a list of named parameters");
    }
    for (size_t k = 0; k < ps.size(); ++k) {
      if (!ps[k].is_leaf() || !ps[k].requires_grad() || ps[k].scalar_type() != ps[0].scalar_type() ||
          ps[k].device() != ps[0].device()) {
        throw std::invalid_argument("--zero_stage 3: " + unit.spec.names[k] + " in unit " + unit.spec.name +
                                    " is not a trained leaf of the unit's dtype and device");
      }
      unit.offsets.push_back(unit.elements);
      unit.elements += ps[k].numel();
    }
    unit.chunk = (unit.elements + N - 1) / N;
    // This rank's range of the unit, copied from each parameter (no copy of the whole unit).
    unit.weights = torch::zeros({unit.chunk}, ps[0].options().requires_grad(false));
    for (size_t k = 0; k < ps.size(); ++k) copy_into_chunk(unit, k, ps[k].detach(), unit.weights);
    unit.gradient = torch::zeros_like(unit.weights);
    // The parameters become views of the full copy, whose storage is then let go.
    unit.full = torch::empty({unit.chunk * N}, unit.weights.options());
    for (size_t k = 0; k < ps.size(); ++k) {
      at::Tensor p = ps[k];
      p.set_data(unit.full.narrow(0, unit.offsets[k], p.numel()).view(p.sizes()));
    }
    unit.full.storage().unsafeGetStorageImpl()->reset();
    unit.fired.assign(ps.size(), 0);
    unit.pending = ps.size();
    for (size_t k = 0; k < ps.size(); ++k) {
      hooks_.push_back(hook_gradient_accumulator(ps[k], this, index_.size()));
      index_.emplace_back(u, k);
    }
  }
  // The whole parameters, replaced by the chunks, are not allocated again: their pages go back
  // to the system (under keep_freed_host_memory() they would stay resident, freed).
  if (ctx_.device.is_cpu()) give_back_freed_host_memory();
}

ShardedUnits::~ShardedUnits() {
  for (auto& [node, key] : hooks_) node->del_post_hook(key);
  for (Unit& unit : units_) {
    for (auto* work : {&unit.gathering, &unit.reducing}) {
      if (*work) {
        try {
          (*work)->wait();
        } catch (...) {  // a destructor must not throw; the failure was reported where it was waited for
        }
      }
    }
  }
}

at::DataPtr ShardedUnits::take_locked(size_t bytes, c10::Allocator* allocator) {
  auto it = pool_.find(bytes);
  if (it == pool_.end() || it->second.empty()) return allocator->allocate(bytes);
  at::DataPtr data = std::move(it->second.back());
  it->second.pop_back();
  pooled_bytes_ -= static_cast<int64_t>(bytes);
  return data;
}

void ShardedUnits::give_locked(size_t bytes, at::DataPtr data) {
  if (!data) return;
  pool_[bytes].push_back(std::move(data));
  pooled_bytes_ += static_cast<int64_t>(bytes);
}

void ShardedUnits::fill_storage_locked(c10::StorageImpl& storage, size_t bytes) {
  storage.set_data_ptr_noswap(take_locked(bytes, storage.allocator()));
  storage.set_nbytes(bytes);
}

size_t ShardedUnits::empty_storage_locked(c10::StorageImpl& storage) {
  const size_t bytes = storage.nbytes();
  give_locked(bytes, storage.set_data_ptr(at::DataPtr(nullptr, storage.device())));
  storage.set_nbytes(0);
  return bytes;
}

at::Tensor ShardedUnits::pooled_empty_locked(int64_t numel, const at::TensorOptions& options) {
  at::Tensor out = torch::empty({0}, options);
  fill_storage_locked(*out.storage().unsafeGetStorageImpl(), static_cast<size_t>(numel) * out.element_size());
  out.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return out;
}

void ShardedUnits::recycle_locked(at::Tensor& tensor) {
  // Only once its collective is done (waited for): whatever still refers to the storage (the
  // finished Work) no longer reads it.
  if (!tensor.defined()) return;
  empty_storage_locked(*tensor.storage().unsafeGetStorageImpl());
  tensor = at::Tensor();
}

void ShardedUnits::allocate_locked(Unit& unit) {
  const size_t bytes = static_cast<size_t>(unit.full.numel()) * unit.full.element_size();
  fill_storage_locked(*unit.full.storage().unsafeGetStorageImpl(), bytes);
  unit.here = true;
  live_bytes_ += static_cast<int64_t>(bytes);
  if (!gathering_all_) peak_bytes_ = std::max(peak_bytes_, live_bytes_);
}

void ShardedUnits::free_locked(Unit& unit) {
  if (!unit.here) return;
  live_bytes_ -= static_cast<int64_t>(empty_storage_locked(*unit.full.storage().unsafeGetStorageImpl()));
  unit.here = false;
}

void ShardedUnits::gather(size_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  Unit& unit = units_.at(u);
  if (unit.here) return;
  allocate_locked(unit);
  if (ctx_.backend == Backend::kGloo) {  // as BucketedAllReduce's gathers: an all-to-all is faster here
    unit.gather_send = pooled_empty_locked(unit.chunk * ctx_.world_size, unit.weights.options());
    unit.gather_send.view({ctx_.world_size, unit.chunk}).copy_(unit.weights.unsqueeze(0).expand({ctx_.world_size, unit.chunk}));
    unit.gathering = data_parallel::all_to_all_even(*ctx_.group, unit.full, unit.gather_send);
  } else {
    unit.gathering = ctx_.group->_allgather_base(unit.full, unit.weights);
  }
}

void ShardedUnits::wait(size_t u) {
  gather(u);
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    work = std::move(units_.at(u).gathering);
    units_.at(u).gathering.reset();
  }
  if (work) work->wait();
  work.reset();
  std::lock_guard<std::mutex> lock(mutex_);
  recycle_locked(units_.at(u).gather_send);
}

void ShardedUnits::release(size_t u) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Unit& unit = units_.at(u);
    if (!unit.here || unit.kept) return;
  }
  wait(u);  // a gather still writing into the storage finishes first
  std::lock_guard<std::mutex> lock(mutex_);
  free_locked(units_.at(u));
}

bool ShardedUnits::gathered(size_t u) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return units_.at(u).here;
}

void ShardedUnits::gather_all() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gathering_all_ = true;
  }
  for (size_t u = 0; u < units_.size(); ++u) gather(u);
  for (size_t u = 0; u < units_.size(); ++u) wait(u);
  std::lock_guard<std::mutex> lock(mutex_);
  for (Unit& unit : units_) unit.kept = true;
  gathering_all_ = false;
}

void ShardedUnits::release_all() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Unit& unit : units_) unit.kept = false;
  }
  for (size_t u = 0; u < units_.size(); ++u) release(u);
}

int64_t ShardedUnits::live_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_bytes_;
}

int64_t ShardedUnits::pooled_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pooled_bytes_;
}

int64_t ShardedUnits::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_bytes_;
}

void ShardedUnits::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_bytes_ = live_bytes_;
}

void ShardedUnits::attach(std::vector<at::Tensor>) {
  throw std::logic_error("ShardedUnits: the units are given at construction, not attached");
}

void ShardedUnits::add(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto [u, k] = index_.at(index);
  Unit& unit = units_[u];
  if (unit.launched) return;  // a late accumulation: finalize() reduces it again
  if (++unit.fired[k] != unit.spec.accumulations[k] * expected_accumulations_) return;
  if (--unit.pending != 0) return;
  // Every parameter of the unit has its gradient of this backward: into the chunks, and the
  // unit's full weights (no longer needed by its backward) let go.
  launch_reduce_locked(unit);
  if (!unit.kept && !unit.gathering) free_locked(unit);
}

void ShardedUnits::launch_reduce_locked(Unit& unit) {
  torch::NoGradGuard no_grad;
  // The unit's gradients, flattened in its layout (missing ones and the padding zeros), into a
  // buffer of the pool; the full gradients let go.
  const int64_t N = ctx_.world_size;
  const at::ScalarType wire = reduce_dtype_ ? *reduce_dtype_ : unit.weights.scalar_type();
  unit.buffer = pooled_empty_locked(unit.chunk * N, unit.weights.options().dtype(wire));
  for (size_t k = 0; k < unit.spec.parameters.size(); ++k) {
    at::Tensor parameter = unit.spec.parameters[k];
    at::Tensor into = unit.buffer.narrow(0, unit.offsets[k], parameter.numel());
    if (parameter.grad().defined()) {
      into.copy_(parameter.grad().reshape({-1}));
    } else {
      into.zero_();
    }
    parameter.mutable_grad() = at::Tensor();
  }
  if (unit.chunk * N > unit.elements) unit.buffer.narrow(0, unit.elements, unit.chunk * N - unit.elements).zero_();
  communicated_bytes_ += unit.buffer.numel() * static_cast<int64_t>(unit.buffer.element_size());
  if (ctx_.backend == Backend::kGloo) {  // every rank's copy of this rank's chunk, summed when settled
    unit.received = pooled_empty_locked(unit.buffer.numel(), unit.buffer.options());
    unit.reducing = data_parallel::all_to_all_even(*ctx_.group, unit.received, unit.buffer);
  } else {
    unit.received = pooled_empty_locked(unit.chunk, unit.buffer.options());
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    unit.reducing = ctx_.group->_reduce_scatter_base(unit.received, unit.buffer, options);
  }
  unit.launched = true;
  // At most two units' reduce-scatters in flight (their buffers the only full gradients kept):
  // those done are folded into their chunks now, and the oldest waited for beyond that.
  reducing_.push_back(&unit);
  while (!reducing_.empty() &&
         (reducing_.size() > 2 || !reducing_.front()->reducing || reducing_.front()->reducing->isCompleted())) {
    Unit* oldest = reducing_.front();
    reducing_.pop_front();
    settle_reduce_locked(*oldest);
  }
}

void ShardedUnits::settle_reduce_locked(Unit& unit) {
  if (!unit.reducing) return;
  unit.reducing->wait();
  unit.reducing.reset();
  torch::NoGradGuard no_grad;
  const at::ScalarType dtype = unit.weights.scalar_type();
  at::Tensor sum;
  if (ctx_.backend == Backend::kGloo) {
    const at::Tensor copies = unit.received.view({ctx_.world_size, -1});
    sum = copies[0].scalar_type() == dtype ? copies[0] : copies[0].to(dtype);  // summed in place, in the pool's buffer
    for (int64_t r = 1; r < ctx_.world_size; ++r) sum.add_(copies[r]);
  } else {
    sum = unit.received.to(dtype);
  }
  unit.gradient.add_(sum.div_(static_cast<double>(ctx_.world_size)));
  recycle_locked(unit.buffer);
  recycle_locked(unit.received);
}

void ShardedUnits::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Unit& unit : units_) {
    if (unit.launched) continue;
    // Not complete in backward: a parameter got fewer accumulations than it should. The other
    // ranks would have reduced the unit during their backward, in another order: stop here.
    for (size_t k = 0; k < unit.fired.size(); ++k) {
      if (unit.fired[k] != unit.spec.accumulations[k] * expected_accumulations_) {
        const std::string message = "--zero_stage 3: " + unit.spec.names[k] + " (unit " + unit.spec.name + ") got " +
                                    std::to_string(unit.fired[k]) + " gradient accumulations in this backward, not " +
                                    std::to_string(unit.spec.accumulations[k] * expected_accumulations_) +
                                    "; a sharded unit needs every parameter's gradient in every backward";
        reset_backward_locked();
        throw std::runtime_error(message);
      }
    }
  }
  for (Unit& unit : units_) settle_reduce_locked(unit);
  reducing_.clear();
  // A gradient accumulated after its unit left (a weight used again) is reduced again and added,
  // the same units on every rank (agreed first by one MAX all-reduce of a flag per unit).
  at::Tensor late = torch::zeros({static_cast<int64_t>(units_.size())}, torch::kInt);
  for (size_t u = 0; u < units_.size(); ++u) {
    for (const at::Tensor& p : units_[u].spec.parameters) {
      if (p.grad().defined()) late[static_cast<int64_t>(u)] = 1;
    }
  }
  std::vector<at::Tensor> agreement{late.to(ctx_.device.torch_device())};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  ctx_.group->allreduce(agreement, max)->wait();
  late = agreement[0].to(torch::kCPU);
  for (size_t u = 0; u < units_.size(); ++u) {
    if (late[static_cast<int64_t>(u)].item<int>() == 0) continue;
    launch_reduce_locked(units_[u]);
    settle_reduce_locked(units_[u]);
  }
  reducing_.clear();
  reset_backward_locked();
  ++finalized_steps_;
}

void ShardedUnits::reset_backward_locked() {
  for (Unit& unit : units_) {
    std::fill(unit.fired.begin(), unit.fired.end(), 0);
    unit.pending = unit.fired.size();
    unit.launched = false;
  }
}

void ShardedUnits::discard_gradients() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Unit& unit : units_) unit.gradient.zero_();
}

std::vector<at::Tensor> ShardedUnits::gather_unit(size_t u, const at::Tensor& chunk) const {
  const Unit& unit = units_.at(u);
  at::Tensor mine = chunk.contiguous();
  at::Tensor all = torch::empty({unit.chunk * ctx_.world_size}, mine.options());
  if (ctx_.backend == Backend::kGloo) {
    at::Tensor send = mine.repeat({ctx_.world_size});
    data_parallel::all_to_all_even(*ctx_.group, all, send)->wait();
  } else {
    ctx_.group->_allgather_base(all, mine)->wait();
  }
  std::vector<at::Tensor> parts;
  for (size_t k = 0; k < unit.spec.parameters.size(); ++k) {
    const at::Tensor& p = unit.spec.parameters[k];
    parts.push_back(all.narrow(0, unit.offsets[k], p.numel()).view(p.sizes()));
  }
  return parts;
}

void ShardedUnits::copy_into_chunk(size_t u, size_t k, const at::Tensor& full, at::Tensor& chunk) const {
  copy_into_chunk(units_.at(u), k, full, chunk);
}

void ShardedUnits::copy_into_chunk(const Unit& unit, size_t k, const at::Tensor& full, at::Tensor& chunk) const {
  torch::NoGradGuard no_grad;
  const int64_t n = unit.spec.parameters.at(k).numel();
  if (full.numel() != n) {
    throw std::invalid_argument(unit.spec.names[k] + ": " + std::to_string(full.numel()) + " elements, the parameter has " +
                                std::to_string(n));
  }
  const ChunkOverlap mine = chunk_overlap(ctx_.rank, unit.chunk, unit.offsets[k], n);
  if (mine.length == 0) return;
  chunk.narrow(0, mine.in_chunk, mine.length)
      .copy_(full.reshape({-1}).narrow(0, mine.in_tensor, mine.length).to(chunk.device(), chunk.scalar_type()));
}

}  // namespace harness::zero
