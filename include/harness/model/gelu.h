// GPT-2's activation, Hugging Face's "gelu_new": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// On the CPU, for float and bfloat16 tensors (a non-contiguous one is copied first), forward and
// backward are each one vectorized pass of our own (tanh from a polynomial exp; within float
// rounding of ATen's, and about four times faster forward and twice backward, where ATen's tanh
// dominates a GPT-2 step's element-wise time). bfloat16 is computed in float and rounded once.
// That backward is first-order only: it is not itself differentiable (no double backward).
// Anywhere else: at::gelu(x, "tanh"), whose fused CUDA kernel is already one pass.
#pragma once

#include <ATen/core/Tensor.h>

namespace harness::model {

at::Tensor gelu_tanh(const at::Tensor& x);

}  // namespace harness::model
