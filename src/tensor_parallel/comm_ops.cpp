// Autograd functions for the tensor-parallel communication (see comm_ops.h). The process group
// travels in the autograd context as a capsule, which also keeps it alive until backward ran.
#include "harness/tensor_parallel/comm_ops.h"

#include <torch/torch.h>

#include <stdexcept>

#include "harness/data_parallel/ring_all_reduce.h"

namespace harness::tensor_parallel {
namespace {

namespace dp = harness::data_parallel;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Group = c10::intrusive_ptr<c10d::Backend>;

constexpr const char* kGroup = "tp_group";

void save_group(AutogradContext* ctx, const Group& group) {
  ctx->saved_data[kGroup] = c10::IValue::make_capsule(group);
}

Group saved_group(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<c10d::Backend>(ctx->saved_data[kGroup].toCapsule());
}

at::Tensor all_reduce_copy(const at::Tensor& x, const Group& group) {
  std::vector<at::Tensor> buffers{x.contiguous().clone()};
  if (group->getSize() > 1) {
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    group->allreduce(buffers, opts)->wait();
  }
  return buffers[0];
}

std::vector<at::Tensor> gather_parts(const at::Tensor& x, const Group& group) {
  const int size = group->getSize();
  std::vector<at::Tensor> input{x.contiguous()};
  if (size == 1) return {input[0].clone()};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < size; ++r) output[0].push_back(torch::empty_like(input[0]));
  group->allgather(output, input)->wait();
  return output[0];
}

// x [..., n, ...] (n at `dim`) as its T parts stacked in front, [T, ..., n / T, ...], contiguous:
// what the flat collectives split and join.
at::Tensor parts_in_front(const at::Tensor& x, int64_t dim, int parts) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[static_cast<size_t>(dim)] /= parts;
  sizes.insert(sizes.begin() + dim, parts);
  return x.reshape(sizes).movedim(dim, 0).contiguous();
}

// The inverse: [T, ..., m, ...] -> [..., T * m, ...].
at::Tensor parts_joined(const at::Tensor& stacked, int64_t dim) {
  const at::Tensor moved = stacked.movedim(0, dim);
  std::vector<int64_t> sizes = moved.sizes().vec();
  sizes[static_cast<size_t>(dim)] *= sizes[static_cast<size_t>(dim) + 1];
  sizes.erase(sizes.begin() + dim + 1);
  return moved.reshape(sizes);
}

constexpr int kRingTag = 0x5e9;  // the tensor group's only point-to-point traffic

// On the CPU (Gloo) the parts go round a ring straight into and out of their slots of [T, ...]:
// Gloo's own all-gather and reduce-scatter copy through flat buffers of their own on the way.
at::Tensor ring_gather(const at::Tensor& mine, const Group& group) {
  const int size = group->getSize(), rank = group->getRank();
  std::vector<int64_t> sizes = mine.sizes().vec();
  sizes.insert(sizes.begin(), size);
  at::Tensor all = at::empty(sizes, mine.options());
  all[rank].copy_(mine);
  for (int step = 0; step + 1 < size; ++step) {  // pass on what came in the step before
    dp::ring_exchange(group, all[(rank - step + size) % size], all[(rank - step - 1 + 2 * size) % size], kRingTag);
  }
  return all;
}

at::Tensor ring_reduce_scatter(const at::Tensor& stacked, const Group& group) {
  const int size = group->getSize(), rank = group->getRank();
  // Step s sends the partial sum of part rank - s - 1 and adds this rank's share to the partial
  // sum of part rank - s - 2 that arrives; after T - 1 steps that part is this rank's, whole.
  at::Tensor partial = stacked[(rank - 1 + size) % size].clone();
  for (int step = 0; step + 1 < size; ++step) {
    at::Tensor arrived = at::empty_like(partial);
    dp::ring_exchange(group, partial, arrived, kRingTag);
    partial = arrived.add_(stacked[(rank - step - 2 + 2 * size) % size]);
  }
  return partial;
}

at::Tensor gather_along(const at::Tensor& x, int64_t dim, const Group& group) {
  const int size = group->getSize();
  if (size == 1) return x.clone();
  if (x.is_cpu()) return parts_joined(ring_gather(x.contiguous(), group), dim);
  // The flat collectives join and split along the first dimension: [T * n0, ...].
  at::Tensor mine = x.contiguous().unsqueeze(0);
  std::vector<int64_t> sizes = mine.sizes().vec();
  sizes[0] = size;
  at::Tensor all = at::empty(sizes, mine.options());
  group->_allgather_base(all, mine)->wait();
  return parts_joined(all, dim);
}

at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const Group& group) {
  const int size = group->getSize();
  if (x.size(dim) % size != 0) {
    throw std::invalid_argument("reduce_scatter_sequence: dimension " + std::to_string(dim) + " of length " +
                                std::to_string(x.size(dim)) + " is not divisible over " + std::to_string(size) +
                                " tensor-parallel ranks");
  }
  if (size == 1) return x.clone();
  at::Tensor stacked = parts_in_front(x, dim, size);
  if (stacked.is_cpu()) return ring_reduce_scatter(stacked, group);
  std::vector<int64_t> part_sizes = stacked.sizes().vec();
  part_sizes[0] = 1;  // [T, ...] in, this rank's [1, ...] out
  at::Tensor mine = at::empty(part_sizes, stacked.options());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  group->_reduce_scatter_base(mine, stacked, opts)->wait();
  return mine.squeeze(0);
}

constexpr const char* kDim = "dim";

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, Group group) {
    save_group(ctx, group);
    ctx->saved_data[kDim] = dim;
    return gather_along(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter_along(grads[0], ctx->saved_data[kDim].toInt(), saved_group(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, Group group) {
    save_group(ctx, group);
    ctx->saved_data[kDim] = dim;
    return reduce_scatter_along(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather_along(grads[0], ctx->saved_data[kDim].toInt(), saved_group(ctx)), at::Tensor(), at::Tensor()};
  }
};

int64_t checked_dim(const at::Tensor& x, int64_t dim, const char* what) {
  const int64_t dims = x.dim();
  if (dim < -dims || dim >= dims) {
    throw std::invalid_argument(std::string(what) + ": dimension " + std::to_string(dim) + " is outside a tensor of " +
                                std::to_string(dims) + " dimensions");
  }
  return dim < 0 ? dim + dims : dim;
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group) {
    save_group(ctx, group);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce_copy(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group group) {
    return all_reduce_copy(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

const Group& checked(const dp::DistContext& tp, const char* what) {
  if (!tp.group) {
    throw std::invalid_argument(std::string(what) + ": the tensor-parallel context has no process group");
  }
  return tp.group;
}

}  // namespace

at::Tensor copy_to_tp_region(const at::Tensor& x, const dp::DistContext& tp) {
  return CopyToRegion::apply(x, checked(tp, "copy_to_tp_region"));
}

at::Tensor reduce_from_tp_region(const at::Tensor& x, const dp::DistContext& tp) {
  return ReduceFromRegion::apply(x, checked(tp, "reduce_from_tp_region"));
}

at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, const dp::DistContext& tp) {
  return GatherSequence::apply(x, checked_dim(x, dim, "gather_sequence"), checked(tp, "gather_sequence"));
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const dp::DistContext& tp) {
  return ReduceScatterSequence::apply(x, checked_dim(x, dim, "reduce_scatter_sequence"),
                                      checked(tp, "reduce_scatter_sequence"));
}

std::vector<at::Tensor> all_gather(const at::Tensor& x, const dp::DistContext& tp) {
  torch::NoGradGuard no_grad;
  return gather_parts(x.detach(), checked(tp, "all_gather"));
}

}  // namespace harness::tensor_parallel
