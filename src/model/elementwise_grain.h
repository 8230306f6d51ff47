// How finely the CPU element-wise kernels (GELU, dropout) split a tensor over the intra-op threads.
#pragma once

#include <cstdint>

namespace harness::model::detail {

constexpr int64_t kElementwiseGrain = 32768;  // elements per parallel task

}  // namespace harness::model::detail
