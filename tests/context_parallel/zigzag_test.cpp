// The zigzag split as plain tables: which positions each rank holds, shards and their inverse,
// which causal blocks are skipped, and the refusals with their numbers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "harness/model/context_parallel.h"
#include "test_support.h"

namespace harness::model {
namespace {

using Positions = std::vector<int64_t>;
using context_parallel::testing::error_of;

TEST(Zigzag, PositionsOfEightOverTwoRanks) {
  // chunks of 2: 0 1 | 2 3 | 4 5 | 6 7 -> rank 0 chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(zigzag_positions(8, 2, 0), (Positions{0, 1, 6, 7}));
  EXPECT_EQ(zigzag_positions(8, 2, 1), (Positions{2, 3, 4, 5}));
}

TEST(Zigzag, PositionsOfTwelveOverThreeRanks) {
  EXPECT_EQ(zigzag_positions(12, 3, 0), (Positions{0, 1, 10, 11}));
  EXPECT_EQ(zigzag_positions(12, 3, 1), (Positions{2, 3, 8, 9}));
  EXPECT_EQ(zigzag_positions(12, 3, 2), (Positions{4, 5, 6, 7}));
}

TEST(Zigzag, PositionsOfTwelveOverTwoRanksAndOfOneRank) {
  EXPECT_EQ(zigzag_positions(12, 2, 0), (Positions{0, 1, 2, 9, 10, 11}));
  EXPECT_EQ(zigzag_positions(12, 2, 1), (Positions{3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(zigzag_positions(4, 1, 0), (Positions{0, 1, 2, 3}));
}

TEST(Zigzag, ChunksAndCausalBlocks) {
  EXPECT_EQ(zigzag_chunks(4, 0), (std::pair<int64_t, int64_t>{0, 7}));
  EXPECT_EQ(zigzag_chunks(4, 3), (std::pair<int64_t, int64_t>{3, 4}));
  EXPECT_EQ(causal_block(3, 1), CausalBlock::kFull);
  EXPECT_EQ(causal_block(3, 3), CausalBlock::kDiagonal);
  EXPECT_EQ(causal_block(3, 4), CausalBlock::kSkip);
  // Over the ring every rank computes the same number of full-block equivalents (the zigzag's
  // point): C = 4, 2C = 8 chunks; a diagonal counts one half.
  for (int rank = 0; rank < 4; ++rank) {
    const auto [a, b] = zigzag_chunks(4, rank);
    double work = 0;
    for (int64_t query : {a, b}) {
      for (int64_t key = 0; key < 8; ++key) {
        const CausalBlock kind = causal_block(query, key);
        work += kind == CausalBlock::kFull ? 1 : kind == CausalBlock::kDiagonal ? 0.5 : 0;
      }
    }
    EXPECT_EQ(work, 8) << "rank " << rank;
  }
}

TEST(Zigzag, ShardHoldsThePositionsAndUnshardInvertsIt) {
  const at::Tensor x = torch::arange(2 * 12 * 3).view({2, 12, 3});
  std::vector<at::Tensor> shards;
  for (int rank = 0; rank < 3; ++rank) {
    const at::Tensor shard = zigzag_shard(x, 1, 3, rank);
    const at::Tensor positions = torch::tensor(zigzag_positions(12, 3, rank));
    EXPECT_TRUE(torch::equal(shard, x.index_select(1, positions))) << "rank " << rank;
    EXPECT_TRUE(torch::equal(zigzag_shard(x, -2, 3, rank), shard)) << "negative dim";
    shards.push_back(shard);
  }
  EXPECT_TRUE(torch::equal(zigzag_unshard(shards, 1), x));
  EXPECT_TRUE(torch::equal(zigzag_unshard({zigzag_shard(x, 1, 1, 0)}, 1), x));
  EXPECT_TRUE(torch::equal(zigzag_shard(x, 1, 1, 0), x)) << "one rank holds the sequence in order";
}

TEST(Zigzag, LengthsThatDoNotSplitIntoTwoCChunksAreRefusedWithTheNumbers) {
  const at::Tensor x = torch::zeros({1, 10});
  EXPECT_EQ(error_of([&] { zigzag_shard(x, 1, 2, 0); }),
            "sequence length 10 is not divisible by 2 x --context_parallel_size 2 = 4 "
            "(the zigzag split gives each rank two equal chunks)");
  EXPECT_NE(error_of([] { zigzag_positions(12, 4, 0); })
                .find("sequence length 12 is not divisible by 2 x --context_parallel_size 4 = 8"),
            std::string::npos);
  EXPECT_EQ(error_of([] { check_zigzag_split(8, 0); }), "--context_parallel_size 0 must be at least 1");
  EXPECT_NE(error_of([] { zigzag_positions(12, 3, 3); }).find("rank 3 is not in [0, 3)"), std::string::npos);
  EXPECT_NE(error_of([] { zigzag_unshard({torch::zeros({2, 4}), torch::zeros({2, 6})}, 1); })
                .find("rank 1's shard has shape [2, 6], rank 0's [2, 4]"),
            std::string::npos);
  EXPECT_NE(error_of([] { zigzag_unshard({torch::zeros({2, 3})}, 1); }).find("holds 3 positions"), std::string::npos);
}

}  // namespace
}  // namespace harness::model
