// The loops behind the CPU dropout (see dropout_kernel.h). Like gelu_kernel.cpp, this file includes
// no torch header and is compiled with -O3 (CMakeLists.txt), and target_clones gives each loop an
// x86-64-v4 (AVX-512 with 64-bit multiplies), an AVX2 and a plain copy, picked when the program
// loads. The 64-bit hashes are drawn a block at a time into an array, read back as 32-bit words:
// written this way, both loops vectorize; drawn pair by pair, neither did (8x slower).
#include "dropout_kernel.h"

#include <cstdint>
#include <cstring>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "element 2j's bits are the low word of draw j");

namespace harness::model::detail {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr int64_t kBlock = 256;  // draws per block: 512 elements

// splitmix64's output function: a bijection of 64-bit words whose outputs, for inputs a fixed odd
// step apart, pass BigCrush (Steele et al., "Fast splittable pseudorandom number generators").
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline float from_bf16(uint16_t word) { return __builtin_bit_cast(float, static_cast<uint32_t>(word) << 16); }

// c10::BFloat16's rounding: to nearest, ties to even; any NaN becomes the quiet NaN 0x7FC0.
inline uint16_t to_bf16(float value) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, value);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return value != value ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// Calls visit(offset, words, count) for consecutive blocks of elements [first, first + n): words[i]
// holds element first + offset + i's random bits.
template <typename Visit>
inline __attribute__((always_inline)) void for_each_block(int64_t first, int64_t n, uint64_t seed, Visit visit) {
  uint64_t draws[kBlock];
  uint32_t words[2 * kBlock];
  const uint64_t first_draw = static_cast<uint64_t>(first / 2);
  for (int64_t offset = 0; offset < n; offset += 2 * kBlock) {
    const int64_t count = n - offset < 2 * kBlock ? n - offset : 2 * kBlock;
    const int64_t pairs = (count + 1) / 2;
    const uint64_t base = first_draw + static_cast<uint64_t>(offset / 2);
    for (int64_t j = 0; j < pairs; ++j) draws[j] = mix64(seed + (base + static_cast<uint64_t>(j)) * kGolden);
    std::memcpy(words, draws, sizeof(uint64_t) * static_cast<size_t>(pairs));
    visit(offset, words, count);
  }
}

// y[i] = x[i] * (kept ? scale : 0) and keep[i], x's words read through `load` into float and
// the products written through `store` (lambdas: passed as function pointers, the bf16 loop did
// not vectorize and ran 10x slower).
template <typename T, typename Load, typename Store>
inline __attribute__((always_inline)) void drop_blocks(const T* x, T* y, uint8_t* keep, int64_t first, int64_t n,
                                                       uint64_t seed, uint32_t last_kept, float scale, Load load,
                                                       Store store) {
  for_each_block(first, n, seed, [&](int64_t offset, const uint32_t* words, int64_t count) {
    const T* __restrict in = x + offset;
    T* __restrict out = y + offset;
    uint8_t* __restrict kept = keep + offset;
    for (int64_t i = 0; i < count; ++i) {
      const bool k = words[i] <= last_kept;
      kept[i] = k;
      out[i] = store(load(in[i]) * (k ? scale : 0.0f));
    }
  });
}

}  // namespace

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void dropout_keep_bits(uint8_t* __restrict keep, int64_t first, int64_t n, uint64_t seed, uint32_t last_kept) {
  for_each_block(first, n, seed, [&](int64_t offset, const uint32_t* words, int64_t count) {
    uint8_t* __restrict out = keep + offset;
    for (int64_t i = 0; i < count; ++i) out[i] = words[i] <= last_kept;
  });
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void dropout_forward_f32(const float* __restrict x, float* __restrict y, uint8_t* __restrict keep, int64_t first,
                         int64_t n, uint64_t seed, uint32_t last_kept, float scale) {
  drop_blocks(x, y, keep, first, n, seed, last_kept, scale, [](float v) { return v; }, [](float v) { return v; });
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void dropout_forward_bf16(const uint16_t* __restrict x, uint16_t* __restrict y, uint8_t* __restrict keep,
                          int64_t first, int64_t n, uint64_t seed, uint32_t last_kept, float scale) {
  drop_blocks(x, y, keep, first, n, seed, last_kept, scale, [](uint16_t v) { return from_bf16(v); },
              [](float v) { return to_bf16(v); });
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void dropout_backward_f32(const float* __restrict grad, const uint8_t* __restrict keep, float* __restrict dx,
                          int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dx[i] = grad[i] * (keep[i] ? scale : 0.0f);
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void dropout_backward_bf16(const uint16_t* __restrict grad, const uint8_t* __restrict keep, uint16_t* __restrict dx,
                           int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dx[i] = to_bf16(from_bf16(grad[i]) * (keep[i] ? scale : 0.0f));
}

}  // namespace harness::model::detail
