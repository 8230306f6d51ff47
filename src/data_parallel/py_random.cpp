// MT19937 as in CPython's Modules/_randommodule.c (the reference algorithm of Matsumoto and
// Nishimura), with CPython's seeding of integers and its getrandbits word order.
#include "harness/data_parallel/py_random.h"

#include <stdexcept>
#include <string>

namespace harness::data_parallel {
namespace {
constexpr int kM = 397;
constexpr uint32_t kMatrixA = 0x9908b0dfU;
constexpr uint32_t kUpperMask = 0x80000000U;
constexpr uint32_t kLowerMask = 0x7fffffffU;

int bit_length(uint64_t n) {
  int k = 0;
  while (n != 0) {
    ++k;
    n >>= 1;
  }
  return k;
}
}  // namespace

PyRandom::PyRandom(int64_t seed) {
  // CPython seeds with abs(seed); the magnitude of INT64_MIN still fits in uint64_t.
  const uint64_t magnitude = seed < 0 ? uint64_t(0) - static_cast<uint64_t>(seed)
                                      : static_cast<uint64_t>(seed);
  *this = from_unsigned(magnitude);
}

PyRandom PyRandom::from_unsigned(uint64_t seed) {
  std::vector<uint32_t> key;
  for (uint64_t rest = seed; rest != 0; rest >>= 32) key.push_back(static_cast<uint32_t>(rest));
  if (key.empty()) key.push_back(0);  // CPython: a zero seed is the one-word key [0]
  PyRandom r;
  r.init_by_array(key);
  return r;
}

void PyRandom::init_genrand(uint32_t s) {
  mt_[0] = s;
  for (int i = 1; i < kN; ++i) {
    mt_[i] = 1812433253U * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + static_cast<uint32_t>(i);
  }
  mti_ = kN;
}

void PyRandom::init_by_array(const std::vector<uint32_t>& key) {
  init_genrand(19650218U);
  const size_t key_length = key.size();
  size_t i = 1, j = 0;
  for (size_t k = (kN > key_length ? kN : key_length); k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525U)) + key[j] +
             static_cast<uint32_t>(j);
    ++i;
    ++j;
    if (i >= kN) {
      mt_[0] = mt_[kN - 1];
      i = 1;
    }
    if (j >= key_length) j = 0;
  }
  for (size_t k = kN - 1; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941U)) -
             static_cast<uint32_t>(i);
    ++i;
    if (i >= kN) {
      mt_[0] = mt_[kN - 1];
      i = 1;
    }
  }
  mt_[0] = 0x80000000U;  // the most significant bit is 1: a non-zero initial array
  mti_ = kN;
}

uint32_t PyRandom::next_uint32() {
  static constexpr uint32_t kMag01[2] = {0U, kMatrixA};
  if (mti_ >= kN) {
    int kk = 0;
    for (; kk < kN - kM; ++kk) {
      const uint32_t y = (mt_[kk] & kUpperMask) | (mt_[kk + 1] & kLowerMask);
      mt_[kk] = mt_[kk + kM] ^ (y >> 1) ^ kMag01[y & 1U];
    }
    for (; kk < kN - 1; ++kk) {
      const uint32_t y = (mt_[kk] & kUpperMask) | (mt_[kk + 1] & kLowerMask);
      mt_[kk] = mt_[kk + (kM - kN)] ^ (y >> 1) ^ kMag01[y & 1U];
    }
    const uint32_t y = (mt_[kN - 1] & kUpperMask) | (mt_[0] & kLowerMask);
    mt_[kN - 1] = mt_[kM - 1] ^ (y >> 1) ^ kMag01[y & 1U];
    mti_ = 0;
  }
  uint32_t y = mt_[mti_++];
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  y ^= (y >> 18);
  return y;
}

uint64_t PyRandom::getrandbits(int k) {
  if (k < 0 || k > 64) {
    throw std::invalid_argument("PyRandom::getrandbits: k = " + std::to_string(k) +
                                " is outside [0, 64]");
  }
  if (k == 0) return 0;
  if (k <= 32) return next_uint32() >> (32 - k);
  // CPython fills 32-bit words least significant first; the last word keeps its top bits.
  const uint64_t low = next_uint32();
  const uint64_t high = next_uint32() >> (64 - k);
  return low | (high << 32);
}

uint64_t PyRandom::randbelow(uint64_t n) {
  if (n == 0) throw std::invalid_argument("PyRandom::randbelow: n must be positive, got 0");
  const int k = bit_length(n);
  uint64_t r = getrandbits(k);
  while (r >= n) r = getrandbits(k);
  return r;
}

double PyRandom::random() {
  const uint32_t a = next_uint32() >> 5;
  const uint32_t b = next_uint32() >> 6;
  return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
}

}  // namespace harness::data_parallel
