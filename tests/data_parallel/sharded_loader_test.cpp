// Epoch-wise resharding: seed + epoch permutations (against orders CPython printed), partitions
// disjoint and covering every epoch, epoch 0 the original's, and ShardedLoader's per-epoch loader.
#include "harness/data_parallel/sharded_loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace harness::data_parallel {
namespace {

std::vector<data::TranslationExample> numbered(int n) {
  std::vector<data::TranslationExample> dataset;
  for (int i = 0; i < n; ++i) dataset.push_back({"d" + std::to_string(i), "e" + std::to_string(i)});
  return dataset;
}

data::CollateFn keep_examples() {
  return [](const std::vector<data::TranslationExample>& examples) {
    data::Batch batch;
    batch.examples = examples;
    return batch;
  };
}

std::vector<data::TranslationExample> drain(data::BatchLoader& loader, int64_t epoch) {
  std::vector<data::TranslationExample> seen;
  loader.start_epoch(epoch);
  while (auto batch = loader.next()) {
    seen.insert(seen.end(), batch->examples.begin(), batch->examples.end());
  }
  return seen;
}

TEST(EpochResharding, SeedPlusEpochAsCPythonShufflesIt) {
  EXPECT_EQ(epoch_seed(1234, 0), 1234u);
  EXPECT_EQ(epoch_seed(1234, 2), 1236u);
  EXPECT_THROW(epoch_seed(1234, -1), std::invalid_argument);
  // Python: l = list(range(10)); random.Random(1234 + e).shuffle(l); cut 7 / 2 / 1.
  DataPartitioner<int> partitioner({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {0.7, 0.2, 0.1});
  EXPECT_EQ(partitioner.use(0).indices(), (std::vector<int64_t>{2, 8, 3, 5, 6, 4, 9}));
  partitioner.set_epoch(1);
  EXPECT_EQ(partitioner.epoch(), 1);
  EXPECT_EQ(partitioner.use(0).indices(), (std::vector<int64_t>{5, 4, 0, 9, 2, 1, 3}));
  EXPECT_EQ(partitioner.use(1).indices(), (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(partitioner.use(2).indices(), (std::vector<int64_t>{6}));
  partitioner.set_epoch(2);
  EXPECT_EQ(partitioner.use(0).indices(), (std::vector<int64_t>{3, 1, 5, 0, 6, 4, 2}));
  partitioner.set_epoch(0);  // back to the original's
  EXPECT_EQ(partitioner.use(1).indices(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(partitioner.use(2).indices(), (std::vector<int64_t>{7}));
}

TEST(EpochResharding, EveryEpochDisjointCoveringAndNew) {
  for (int world_size : {2, 3, 4}) {
    const std::vector<double> sizes(static_cast<size_t>(world_size), 1.0 / world_size);
    DataPartitioner<int> partitioner(std::vector<int>(96), sizes);
    std::set<std::vector<int64_t>> rank0_sets;
    for (int64_t epoch = 0; epoch < 5; ++epoch) {
      partitioner.set_epoch(epoch);
      std::set<int64_t> all;
      for (int r = 0; r < world_size; ++r) {
        const std::vector<int64_t> indices = partitioner.use(static_cast<size_t>(r)).indices();
        EXPECT_EQ(indices.size(), 96u / world_size);
        all.insert(indices.begin(), indices.end());
        if (r == 0) {
          std::vector<int64_t> sorted = indices;
          std::sort(sorted.begin(), sorted.end());
          rank0_sets.insert(sorted);
        }
      }
      EXPECT_EQ(all.size(), 96u) << "world " << world_size << " epoch " << epoch;
      EXPECT_EQ(*all.begin(), 0);
      EXPECT_EQ(*all.rbegin(), 95);
    }
    EXPECT_EQ(rank0_sets.size(), 5u) << "rank 0 drew the same examples in two epochs";
  }
}

TEST(ShardedLoader, WithoutReshufflingEveryEpochIsTheOriginalsPartition) {
  const auto dataset = numbered(20);
  ShardedLoader shards(1, 2, dataset, 4, keep_examples());
  EXPECT_FALSE(shards.reshuffles());
  const std::vector<int64_t> original = partition_indices(20, {0.5, 0.5})[1];
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    data::BatchLoader& loader = shards.set_epoch(epoch);
    EXPECT_EQ(shards.indices(), original);
    EXPECT_EQ(loader.batch_size(), 2);
    data::BatchLoader reference = partition_dataset(1, 2, dataset, 4, keep_examples());
    EXPECT_EQ(drain(loader, epoch), drain(reference, epoch));
  }
}

TEST(ShardedLoader, ReshufflingLoadsSeedPlusEpochPartitions) {
  const auto dataset = numbered(20);
  std::vector<ShardedLoader> ranks;
  for (int r = 0; r < 2; ++r) ranks.emplace_back(r, 2, dataset, 4, keep_examples(), 1234, true);
  // Python: l = list(range(20)); random.Random(1235).shuffle(l); halves.
  const std::vector<std::vector<int64_t>> epoch1 = {{0, 8, 18, 19, 9, 2, 7, 16, 1, 3},
                                                    {6, 10, 14, 5, 11, 4, 12, 15, 17, 13}};
  for (int64_t epoch : {0, 1, 2, 1}) {
    std::set<std::string> seen_by_all;
    for (int r = 0; r < 2; ++r) {
      data::BatchLoader& loader = ranks[r].set_epoch(epoch);
      EXPECT_EQ(ranks[r].epoch(), epoch);
      if (epoch == 0) {
        EXPECT_EQ(ranks[r].indices(), partition_indices(20, {0.5, 0.5})[r]);
      }
      if (epoch == 1) {
        EXPECT_EQ(ranks[r].indices(), epoch1[r]);
      }
      const auto seen = drain(loader, epoch);
      ASSERT_EQ(seen.size(), 10u);
      for (size_t i = 0; i < seen.size(); ++i) {
        EXPECT_EQ(seen[i], dataset[static_cast<size_t>(ranks[r].indices()[i])]);
        seen_by_all.insert(seen[i].de);
      }
      // The one-shot API gives the same loader.
      data::BatchLoader same = partition_dataset(r, 2, dataset, 4, keep_examples(), 1234, epoch);
      EXPECT_EQ(drain(same, epoch), seen);
    }
    EXPECT_EQ(seen_by_all.size(), 20u) << "epoch " << epoch;
  }
  EXPECT_THROW(ranks[0].set_epoch(-1), std::invalid_argument);
  EXPECT_THROW(ShardedLoader(2, 2, dataset, 4, keep_examples()), std::invalid_argument);
  EXPECT_THROW(ShardedLoader(0, 3, dataset, 100, keep_examples()), std::invalid_argument);
}

}  // namespace
}  // namespace harness::data_parallel
