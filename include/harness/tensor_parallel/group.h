// The tensor-parallel group a split GPT-2 talks to (model::TensorParallelGroup), over a c10d
// process group: Megatron's f and g as autograd functions (comm_ops.h) and a per-rank dropout
// stream (parallel_rng.h).
#pragma once

#include <memory>

#include "harness/data_parallel/process_group.h"
#include "harness/model/tensor_parallel.h"

namespace harness::tensor_parallel {

// Every rank of `tp` makes one and passes it to model::GPT2LMHeadModel; the ranks' models then
// call its collectives in the same order. Throws when `tp` has no process group.
std::shared_ptr<model::TensorParallelGroup> make_tensor_parallel_group(data_parallel::DistContext tp);

// A process that joins an elastic run under way has no group yet: its rank `rank` of `size`,
// connected later by reconnect_tensor_parallel_group. The model can be built and loaded with it
// meanwhile; its collectives throw std::logic_error until then.
std::shared_ptr<model::TensorParallelGroup> make_unconnected_tensor_parallel_group(int rank, int size);

// Points a group make_tensor_parallel_group (or make_unconnected_tensor_parallel_group) made at
// another process group of the same ranks (its rank and size; elastic training's next
// generation), keeping its dropout streams. Throws
// std::invalid_argument for another kind of group, or another rank or size.
void reconnect_tensor_parallel_group(model::TensorParallelGroup& group, data_parallel::DistContext tp);

}  // namespace harness::tensor_parallel
