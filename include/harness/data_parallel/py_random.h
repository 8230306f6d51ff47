// CPython's random.Random, bit for bit: MT19937 seeded as CPython seeds an int, getrandbits,
// _randbelow and shuffle, so that DataPartitioner gives each rank exactly the original's examples.
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace harness::data_parallel {

class PyRandom {
 public:
  // random.Random(seed): init_by_array over the 32-bit words of |seed|, least significant first.
  explicit PyRandom(int64_t seed);
  static PyRandom from_unsigned(uint64_t seed);

  uint32_t next_uint32();                 // MT19937's genrand_uint32
  uint64_t getrandbits(int k);            // 0 <= k <= 64, as random.getrandbits(k)
  uint64_t randbelow(uint64_t n);         // random._randbelow(n), n > 0: getrandbits rejection
  double random();                        // random.random(): 53 bits from two outputs

  // random.shuffle(x): Fisher-Yates from the end, j = _randbelow(i + 1).
  template <typename T>
  void shuffle(std::vector<T>& x) {
    for (size_t i = x.size(); i-- > 1;) {
      const auto j = static_cast<size_t>(randbelow(static_cast<uint64_t>(i) + 1));
      std::swap(x[i], x[j]);
    }
  }

 private:
  PyRandom() = default;
  void init_genrand(uint32_t s);
  void init_by_array(const std::vector<uint32_t>& key);

  static constexpr int kN = 624;
  std::array<uint32_t, kN> mt_{};
  int mti_ = kN + 1;
};

}  // namespace harness::data_parallel
