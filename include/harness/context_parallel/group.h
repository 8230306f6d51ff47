// The context-parallel group ring attention talks to (model::ContextParallelGroup), over a c10d
// process group: ring exchanges by point-to-point send and receive, and the collectives outside
// autograd.
#pragma once

#include <memory>

#include "harness/data_parallel/process_group.h"
#include "harness/model/context_parallel.h"

namespace harness::context_parallel {

// Every rank of `cp` (ranks local to that group; Gloo or NCCL) makes one and passes it to
// model::ring_attention; the ranks then start their exchanges in the same order. Throws
// std::invalid_argument when `cp` has no process group.
std::shared_ptr<model::ContextParallelGroup> make_context_parallel_group(data_parallel::DistContext cp);

}  // namespace harness::context_parallel
