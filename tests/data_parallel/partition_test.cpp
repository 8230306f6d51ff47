// DataPartitioner: the original's orders (printed by CPython), the a5_1_1 coverage check,
// determinism and errors.
#include "harness/data_parallel/partition.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

namespace harness::data_parallel {
namespace {

std::vector<int> range_vector(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST(DataPartitioner, MatchesThePythonOriginal) {
  // Python: DataPartitioner(list(range(10)), [0.7, 0.2, 0.1]) with seed 1234.
  const auto p = partition_indices(10, {0.7, 0.2, 0.1});
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0], (std::vector<int64_t>{2, 8, 3, 5, 6, 4, 9}));
  EXPECT_EQ(p[1], (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(p[2], (std::vector<int64_t>{7}));
  // Thirds of 13: int(13/3) = 4 each, one example left out.
  const auto thirds = partition_indices(13, {1.0 / 3, 1.0 / 3, 1.0 / 3});
  EXPECT_EQ(thirds[0], (std::vector<int64_t>{2, 3, 8, 4}));
  EXPECT_EQ(thirds[1], (std::vector<int64_t>{11, 6, 5, 9}));
  EXPECT_EQ(thirds[2], (std::vector<int64_t>{10, 0, 1, 7}));
  const auto quarters = partition_indices(128, {0.25, 0.25, 0.25, 0.25});
  EXPECT_EQ(std::vector<int64_t>(quarters[2].begin(), quarters[2].begin() + 8),
            (std::vector<int64_t>{60, 18, 42, 125, 9, 84, 107, 67}));
}

TEST(DataPartitioner, a5_1_1_PartitionsAreDisjointAndCoverTheData) {
  for (int total : {64, 128, 512}) {
    for (int world_size : {2, 4, 8}) {
      SCOPED_TRACE("total " + std::to_string(total) + ", world_size " + std::to_string(world_size));
      const std::vector<double> sizes(static_cast<size_t>(world_size), 1.0 / world_size);
      DataPartitioner<int> partitioner(range_vector(total), sizes);
      ASSERT_EQ(partitioner.num_partitions(), static_cast<size_t>(world_size));
      std::set<int> seen;
      for (int rank = 0; rank < world_size; ++rank) {
        const Partition<int> part = partitioner.use(static_cast<size_t>(rank));
        EXPECT_EQ(part.size(), static_cast<size_t>(total / world_size));
        for (size_t i = 0; i < part.size(); ++i) {
          EXPECT_TRUE(seen.insert(part[i]).second) << "element " << part[i] << " is in two partitions";
          EXPECT_EQ(part[i], part.indices()[i]);  // data = range, so element == index
        }
      }
      // Every size divides evenly here, so the partitions cover everything exactly once.
      EXPECT_EQ(seen.size(), static_cast<size_t>(total));
      EXPECT_EQ(*seen.begin(), 0);
      EXPECT_EQ(*seen.rbegin(), total - 1);
    }
  }
}

TEST(DataPartitioner, a5_1_1_UnevenTotalsLeaveOnlyTheRemainderOut) {
  for (int total : {63, 127, 511}) {
    for (int world_size : {2, 4, 8}) {
      const std::vector<double> sizes(static_cast<size_t>(world_size), 1.0 / world_size);
      const auto parts = partition_indices(total, sizes);
      std::set<int64_t> seen;
      for (const auto& part : parts) {
        EXPECT_EQ(part.size(), static_cast<size_t>(total / world_size));
        for (int64_t i : part) EXPECT_TRUE(seen.insert(i).second);
      }
      EXPECT_EQ(seen.size(), static_cast<size_t>(total / world_size * world_size));
      for (int64_t i : seen) EXPECT_TRUE(i >= 0 && i < total);
    }
  }
}

TEST(DataPartitioner, IsDeterministicAndDependsOnTheSeed) {
  const auto a = partition_indices(512, {0.5, 0.5});
  const auto b = partition_indices(512, {0.5, 0.5});
  EXPECT_EQ(a, b);
  const auto c = partition_indices(512, {0.5, 0.5}, 4321);
  EXPECT_NE(a, c);
  // Views share the data: elements read through the partition equal the data at the indices.
  std::vector<std::string> words;
  for (int i = 0; i < 20; ++i) words.push_back("w" + std::to_string(i));
  DataPartitioner<std::string> partitioner(words, {0.5, 0.5});
  const auto part = partitioner.use(1);
  const auto copy = part.to_vector();
  ASSERT_EQ(copy.size(), 10u);
  for (size_t i = 0; i < copy.size(); ++i) EXPECT_EQ(copy[i], words[part.indices()[i]]);
}

TEST(DataPartitioner, RejectsBadSizesAndIndices) {
  try {
    partition_indices(10, {0.6, 0.5});
    FAIL() << "sizes summing to 1.1 were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sum to 1.1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(partition_indices(10, {0.5, -0.1}), std::invalid_argument);
  // Sums within 1e-9 of one are accepted (thirds add up to 1 plus rounding).
  EXPECT_NO_THROW(partition_indices(10, std::vector<double>(7, 1.0 / 7)));
  DataPartitioner<int> partitioner(range_vector(8), {0.5, 0.5});
  EXPECT_THROW(partitioner.use(2), std::out_of_range);
  EXPECT_THROW(partitioner.use(0).at(4), std::out_of_range);
}

TEST(PartitionDataset, PerDeviceBatchSizeNamesTheFlags) {
  EXPECT_EQ(per_device_batch_size(128, 2), 64);
  EXPECT_EQ(per_device_batch_size(64, 1), 64);
  try {
    per_device_batch_size(100, 3);
    FAIL() << "100 / 3 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--batch_size 100 is not divisible by --world_size 3");
  }
  EXPECT_THROW(per_device_batch_size(128, 0), std::invalid_argument);
  EXPECT_THROW(per_device_batch_size(0, 2), std::invalid_argument);
}

}  // namespace
}  // namespace harness::data_parallel

namespace harness::data_parallel {
namespace {

TEST(PartitionDataset, LoadsRankPartitionInOrderWithThePerDeviceBatch) {
  std::vector<data::TranslationExample> dataset;
  for (int i = 0; i < 20; ++i) dataset.push_back({"d" + std::to_string(i), "e" + std::to_string(i)});
  data::CollateFn collate = [](const std::vector<data::TranslationExample>& examples) {
    data::Batch batch;
    batch.examples = examples;
    return batch;
  };
  const auto plan = partition_indices(20, {0.5, 0.5});
  for (int rank = 0; rank < 2; ++rank) {
    data::BatchLoader loader = partition_dataset(rank, 2, dataset, 4, collate);
    EXPECT_EQ(loader.batch_size(), 2);
    EXPECT_EQ(loader.num_batches(), 5);
    loader.start_epoch(0);
    std::vector<data::TranslationExample> seen;
    while (auto batch = loader.next()) {
      EXPECT_LE(batch->examples.size(), 2u);
      seen.insert(seen.end(), batch->examples.begin(), batch->examples.end());
    }
    ASSERT_EQ(seen.size(), 10u);
    for (size_t i = 0; i < seen.size(); ++i) {
      EXPECT_EQ(seen[i], dataset[static_cast<size_t>(plan[static_cast<size_t>(rank)][i])]);
    }
  }
  EXPECT_THROW(partition_dataset(2, 2, dataset, 4, collate), std::invalid_argument);
  EXPECT_THROW(partition_dataset(-1, 2, dataset, 4, collate), std::invalid_argument);
  EXPECT_THROW(partition_dataset(0, 3, dataset, 100, collate), std::invalid_argument);
}

}  // namespace
}  // namespace harness::data_parallel
