// Element loops of the CPU dropout (see dropout.h) on contiguous arrays. Element i's 32 random
// bits are the low (i even) or high (i odd) half of splitmix64's mix of seed + (i / 2) x the
// golden step; the element is kept when they are at most `last_kept`. A range starts at an even
// element, so that any split of an array into ranges gives the same bits. bf16 arrays are
// uint16_t words, products rounded to nearest even as ATen rounds them. Outputs must not overlap
// inputs.
#pragma once

#include <cstdint>

namespace harness::model::detail {

// keep[i] = 1 where element first + i is kept, else 0, for i in [0, n); first even.
void dropout_keep_bits(uint8_t* keep, int64_t first, int64_t n, uint64_t seed, uint32_t last_kept);

// y[i] = x[i] * (kept ? scale : 0) and keep[i] as above, in one pass.
void dropout_forward_f32(const float* x, float* y, uint8_t* keep, int64_t first, int64_t n, uint64_t seed,
                         uint32_t last_kept, float scale);
void dropout_forward_bf16(const uint16_t* x, uint16_t* y, uint8_t* keep, int64_t first, int64_t n, uint64_t seed,
                          uint32_t last_kept, float scale);

// dx[i] = grad[i] * (keep[i] ? scale : 0).
void dropout_backward_f32(const float* grad, const uint8_t* keep, float* dx, int64_t n, float scale);
void dropout_backward_bf16(const uint16_t* grad, const uint8_t* keep, uint16_t* dx, int64_t n, float scale);

}  // namespace harness::model::detail
