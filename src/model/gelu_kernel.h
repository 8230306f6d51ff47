// Element loops of the tanh-approximated GELU on contiguous float arrays (see gelu.h). Outputs
// must not overlap inputs.
#pragma once

#include <cstdint>

namespace harness::model::detail {

void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_backward(const float* grad, const float* x, float* dx, int64_t n);

}  // namespace harness::model::detail
