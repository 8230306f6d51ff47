// exp of a non-positive float in branch-free arithmetic that vectorizes, for the -O3 kernel files
// (gelu_kernel.cpp, cross_entropy_kernel.cpp). Header-only and torch-free.
#pragma once

#include <cstdint>

namespace harness::model::detail {

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

}  // namespace harness::model::detail
