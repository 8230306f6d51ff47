// PyRandom against values CPython 3.11 printed (random.Random(seed)...), pasted as literals.
#include "harness/data_parallel/py_random.h"

#include <gtest/gtest.h>

#include <numeric>

namespace harness::data_parallel {
namespace {

std::vector<int64_t> shuffled_range(int64_t n, int64_t seed) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  PyRandom(seed).shuffle(v);
  return v;
}

// The same checksum computed in Python: h = (h*1000003 + v*(i+1)) % (2**61-1).
uint64_t checksum(const std::vector<int64_t>& v) {
  const unsigned __int128 p = (uint64_t(1) << 61) - 1;
  unsigned __int128 h = 0;
  for (size_t i = 0; i < v.size(); ++i) h = (h * 1000003 + uint64_t(v[i]) * (i + 1)) % p;
  return static_cast<uint64_t>(h);
}

TEST(PyRandom, ShuffleOfTwentyMatchesCPython) {
  EXPECT_EQ(shuffled_range(20, 1234), (std::vector<int64_t>{19, 13, 4, 9, 16, 7, 6, 8, 17, 18, 5,
                                                             12, 15, 11, 10, 1, 2, 0, 3, 14}));
  EXPECT_EQ(shuffled_range(20, 0), (std::vector<int64_t>{10, 18, 16, 14, 0, 17, 11, 2, 3, 9, 5, 7,
                                                          4, 19, 6, 15, 8, 1, 13, 12}));
  EXPECT_EQ(shuffled_range(20, 1), (std::vector<int64_t>{11, 5, 17, 19, 9, 0, 16, 1, 15, 6, 10, 13,
                                                          14, 12, 7, 3, 8, 2, 18, 4}));
  EXPECT_EQ(shuffled_range(20, 42), (std::vector<int64_t>{19, 5, 14, 4, 9, 13, 15, 18, 6, 12, 17,
                                                           10, 1, 11, 2, 16, 7, 8, 0, 3}));
  // A seed wider than 32 bits: two key words.
  EXPECT_EQ(shuffled_range(20, (int64_t(1) << 40) + 7),
            (std::vector<int64_t>{17, 0, 10, 3, 1, 2, 9, 12, 7, 13, 5, 11, 14, 6, 16, 4, 8, 15, 18,
                                  19}));
}

TEST(PyRandom, NegativeSeedIsItsAbsoluteValue) {
  EXPECT_EQ(shuffled_range(20, -42), shuffled_range(20, 42));
}

TEST(PyRandom, LongShufflesMatchCPythonChecksums) {
  struct Case {
    int64_t seed, n;
    uint64_t sum;
    std::vector<int64_t> head;
  };
  const int64_t big = (int64_t(1) << 40) + 7;
  const std::vector<Case> cases = {
      {1234, 64, 1301589982707710429ULL, {52, 28, 38, 23, 12}},
      {1234, 128, 935280071567378253ULL, {56, 80, 39, 102, 54}},
      {1234, 512, 2031349683975925620ULL, {128, 161, 207, 290, 14}},
      {1234, 1000, 1684148125609044039ULL, {56, 306, 558, 770, 733}},
      {0, 64, 1790005402345270618ULL, {29, 28, 24, 33, 35}},
      {0, 1000, 618171000658245272ULL, {439, 621, 160, 549, 237}},
      {42, 512, 436717598024628905ULL, {225, 213, 344, 127, 455}},
      {42, 1000, 1095461457989660990ULL, {776, 507, 895, 922, 33}},
      {big, 128, 68326971783202896ULL, {83, 117, 25, 103, 99}},
      {big, 1000, 1744913905132785381ULL, {612, 556, 729, 117, 273}},
  };
  for (const auto& c : cases) {
    const auto v = shuffled_range(c.n, c.seed);
    EXPECT_EQ(checksum(v), c.sum) << "seed " << c.seed << " n " << c.n;
    EXPECT_EQ(std::vector<int64_t>(v.begin(), v.begin() + 5), c.head)
        << "seed " << c.seed << " n " << c.n;
  }
}

TEST(PyRandom, GetrandbitsRandbelowAndRandomMatchCPython) {
  PyRandom r(1234);
  EXPECT_EQ(r.getrandbits(32), 4150886329ULL);
  EXPECT_EQ(r.getrandbits(32), 3342196574ULL);
  EXPECT_EQ(r.getrandbits(32), 1892932127ULL);
  EXPECT_EQ(r.getrandbits(7), 14ULL);
  EXPECT_EQ(r.getrandbits(7), 0ULL);
  EXPECT_EQ(r.getrandbits(7), 11ULL);
  EXPECT_EQ(r.getrandbits(40), 1038999730288ULL);
  EXPECT_EQ(r.getrandbits(64), 14886566920684039889ULL);

  PyRandom b((int64_t(1) << 40) + 7);
  for (uint64_t expected : {628, 765, 834, 960, 967}) EXPECT_EQ(b.randbelow(1000), expected);

  PyRandom f(7);
  EXPECT_DOUBLE_EQ(f.random(), 0.32383276483316237);
  EXPECT_DOUBLE_EQ(f.random(), 0.15084917392450192);
}

TEST(PyRandom, RejectsBadArguments) {
  PyRandom r(1);
  EXPECT_THROW(r.getrandbits(65), std::invalid_argument);
  EXPECT_THROW(r.randbelow(0), std::invalid_argument);
}

}  // namespace
}  // namespace harness::data_parallel
