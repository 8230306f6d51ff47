// Pure pieces of tensor parallelism: shard arithmetic, and the checks of a GPT-2 config against
// the tensor-parallel size (the rank layout of the groups: tests/parallel/layout_test.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/model/tensor_parallel.h"
#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

using model::shard_ranges;
using model::shard_tensor;
using model::ShardSpec;
using model::unshard_tensor;
using model::validate_tensor_parallel;
using Kind = ShardSpec::Kind;

TEST(ShardTensor, ColumnsRowsAndFusedParts) {
  const at::Tensor full = torch::arange(4 * 12, torch::kFloat32).reshape({4, 12});
  // Plain columns: rank 1 of 2 holds columns 6..11.
  EXPECT_TRUE(torch::equal(shard_tensor(full, {Kind::kColumns, 1}, 1, 2), full.narrow(1, 6, 6)));
  // Rows: rank 0 of 2 holds rows 0..1.
  EXPECT_TRUE(torch::equal(shard_tensor(full, {Kind::kRows, 1}, 0, 2), full.narrow(0, 0, 2)));
  // c_attn-like [q | k | v] of width 4 each over 2 ranks: rank 1 holds q[2:4], k[2:4], v[2:4],
  // i.e. columns 2,3, 6,7, 10,11.
  const at::Tensor fused = shard_tensor(full, {Kind::kColumns, 3}, 1, 2);
  const at::Tensor expected = torch::cat({full.narrow(1, 2, 2), full.narrow(1, 6, 2), full.narrow(1, 10, 2)}, 1);
  EXPECT_TRUE(torch::equal(fused, expected));
  // A bias (1-D) splits along its only dimension.
  const at::Tensor bias = torch::arange(12, torch::kFloat32);
  EXPECT_TRUE(torch::equal(shard_tensor(bias, {Kind::kColumns, 3}, 0, 2),
                           torch::tensor({0.f, 1.f, 4.f, 5.f, 8.f, 9.f})));
  // Replicated tensors are the full tensor on every rank.
  EXPECT_TRUE(torch::equal(shard_tensor(full, {}, 1, 2), full));
  // unshard inverts shard for every spec and number of ranks that divides.
  for (const ShardSpec spec : {ShardSpec{Kind::kColumns, 1}, ShardSpec{Kind::kColumns, 3},
                               ShardSpec{Kind::kRows, 1}, ShardSpec{Kind::kColumns, 2}}) {
    for (int world : {1, 2, 4}) {
      if (spec.kind == Kind::kColumns && 12 % (spec.fused_parts * world) != 0) continue;
      if (spec.kind == Kind::kRows && 4 % world != 0) continue;
      std::vector<at::Tensor> shards;
      for (int r = 0; r < world; ++r) shards.push_back(shard_tensor(full, spec, r, world));
      EXPECT_TRUE(torch::equal(unshard_tensor(shards, spec), full))
          << "parts " << spec.fused_parts << " world " << world;
    }
  }
}

TEST(ShardTensor, RangesAreWhatAReaderReadsForEachRank) {
  // c_attn of width 3 x 8 over 2 ranks: rank 1 holds [4, 8), [12, 16), [20, 24).
  EXPECT_EQ(shard_ranges(24, {Kind::kColumns, 3}, 1, 2),
            (std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {12, 4}, {20, 4}}));
  EXPECT_EQ(shard_ranges(12, {Kind::kRows, 1}, 2, 3), (std::vector<std::pair<int64_t, int64_t>>{{8, 4}}));
  EXPECT_EQ(shard_ranges(7, {}, 1, 2), (std::vector<std::pair<int64_t, int64_t>>{{0, 7}}));
  EXPECT_THROW(shard_ranges(10, {Kind::kColumns, 3}, 0, 2), std::invalid_argument);
}

TEST(ShardTensor, ErrorsNameTheShape) {
  const at::Tensor full = torch::zeros({4, 10});
  try {
    shard_tensor(full, {Kind::kColumns, 3}, 0, 2);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 10]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("3 fused part(s) x 2 ranks"), std::string::npos) << e.what();
  }
  EXPECT_THROW(shard_tensor(full, {Kind::kRows, 1}, 0, 3), std::invalid_argument);
  EXPECT_THROW(shard_tensor(full, {Kind::kRows, 1}, 2, 2), std::invalid_argument);
}

TEST(ValidateTensorParallel, HeadsAndInnerSizeMustDivide) {
  model::GPT2Config config = testing::tiny_config();  // 4 heads, inner 128
  EXPECT_NO_THROW(validate_tensor_parallel(config, 4));
  try {
    validate_tensor_parallel(config, 3);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("n_head 4 is not divisible by --tensor_parallel_size 3"),
              std::string::npos) << e.what();
  }
  config.n_inner = 30;
  try {
    validate_tensor_parallel(config, 4);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("inner size 30 is not divisible by --tensor_parallel_size 4"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace harness::tensor_parallel
