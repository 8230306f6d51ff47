// The loops behind model::gelu_tanh on the CPU (see gelu.h). This file includes no torch header
// and is compiled with -O3 (CMakeLists.txt): GCC vectorizes these loops only then, and
// target_clones gives each an AVX-512 and an AVX2 copy picked when the program loads.
#include "gelu_kernel.h"

#include <cstdint>

namespace harness::model::detail {
namespace {

// exp(a) for a <= 0, in branch-free float arithmetic that vectorizes: a = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial, 2^n put into the exponent bits.
inline float exp_nonpositive(float a) {
  a = a < -87.0f ? -87.0f : a;
  const float shifted = a * 1.44269504088896341f + 12582912.0f;  // + 1.5 x 2^23 rounds to an integer
  const float n = shifted - 12582912.0f;
  const float r = (a - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t exponent = (__builtin_bit_cast(int32_t, shifted) - 0x4B400000 + 127) << 23;
  return p * __builtin_bit_cast(float, exponent);
}

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
