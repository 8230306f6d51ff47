// The loops behind model::gelu_tanh on the CPU (see gelu.h). This file includes no torch header
// and is compiled with -O3 (CMakeLists.txt): GCC vectorizes these loops only then, and
// target_clones gives each an AVX-512 and an AVX2 copy picked when the program loads.
#include "gelu_kernel.h"

#include <cstdint>

#include "fast_exp.h"

namespace harness::model::detail {
namespace {

// tanh(z) = sign(z) (1 - e) / (1 + e), e = exp(-2|z|).
inline float tanh_of(float z) {
  const float e = exp_nonpositive(-2.0f * __builtin_fabsf(z));
  return __builtin_copysignf((1.0f - e) / (1.0f + e), z);
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

}  // namespace

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_tanh_forward(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = tanh_of(kSqrt2OverPi * (v + kCubic * v * v * v));
    y[i] = 0.5f * v * (1.0f + t);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_tanh_backward(const float* __restrict grad, const float* __restrict x, float* __restrict dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = tanh_of(kSqrt2OverPi * (v + kCubic * v * v * v));
    const float slope =
        0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * v * v);
    dx[i] = grad[i] * slope;
  }
}

}  // namespace harness::model::detail
