// The two communication steps of Megatron-style tensor parallelism (f and g) as autograd
// functions over the tensor-parallel group; each is the other's transpose in the backward pass:
//
//   copy_to_tp_region       forward: identity            backward: all-reduce (sum)
//   reduce_from_tp_region   forward: all-reduce (sum)    backward: identity
//
// and, for sequence parallelism, their split-sequence forms along one dimension of T equal parts:
//
//   gather_sequence          forward: all-gather          backward: reduce-scatter (sum)
//   reduce_scatter_sequence  forward: reduce-scatter      backward: all-gather
//
// Every rank of the group must call them in the same order (they are collectives).
#pragma once

#include <ATen/core/Tensor.h>

#include "harness/data_parallel/process_group.h"

namespace harness::tensor_parallel {

at::Tensor copy_to_tp_region(const at::Tensor& x, const data_parallel::DistContext& tp);
at::Tensor reduce_from_tp_region(const at::Tensor& x, const data_parallel::DistContext& tp);
at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, const data_parallel::DistContext& tp);
at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const data_parallel::DistContext& tp);

// Plain (no autograd) all-gather of equally shaped tensors: result[r] is rank r's tensor.
std::vector<at::Tensor> all_gather(const at::Tensor& x, const data_parallel::DistContext& tp);

}  // namespace harness::tensor_parallel
