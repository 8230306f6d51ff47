// Autograd functions for the tensor-parallel communication (see comm_ops.h). The process group
// travels in the autograd context as a capsule, which also keeps it alive until backward ran.
#include "harness/tensor_parallel/comm_ops.h"

#include <torch/torch.h>

#include <stdexcept>

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

std::vector<at::Tensor> all_gather(const at::Tensor& x, const dp::DistContext& tp) {
  torch::NoGradGuard no_grad;
  return gather_parts(x.detach(), checked(tp, "all_gather"));
}

}  // namespace harness::tensor_parallel
