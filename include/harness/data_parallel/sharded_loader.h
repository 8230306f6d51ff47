// The training loader of one data-parallel rank across epochs: its partition of the dataset, fixed
// (the original's behaviour) or redrawn every epoch from seed + epoch (--reshuffle_each_epoch, as
// DistributedSampler.set_epoch), so that over a run every rank sees every part of the data.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "harness/data/example.h"
#include "harness/data/loader.h"
#include "harness/data_parallel/partition.h"

namespace harness::data_parallel {

class ShardedLoader {
 public:
  // Checks as partition_dataset does (per-device batch size batch_size / world_size, rank in
  // range) and loads epoch 0's partition, which is the original's.
  ShardedLoader(int rank, int world_size, std::vector<data::TranslationExample> dataset,
                int64_t batch_size, data::CollateFn collate,
                uint64_t seed = kDefaultPartitionSeed, bool reshuffle_each_epoch = false);

  // Call at the start of every epoch, on every rank with the same epoch. With reshuffling, this
  // rank's partition becomes that of seed + epoch; without, nothing changes. Returns loader().
  data::BatchLoader& set_epoch(int64_t epoch);

  data::BatchLoader& loader() { return *loader_; }
  int64_t epoch() const { return epoch_; }
  bool reshuffles() const { return reshuffle_each_epoch_; }
  // Dataset indices of this rank's partition for the current epoch, in loading order.
  const std::vector<int64_t>& indices() const { return indices_; }

 private:
  void load(int64_t epoch);

  int rank_;
  int world_size_;
  int64_t device_batch_size_;
  DataPartitioner<data::TranslationExample> partitioner_;
  data::CollateFn collate_;
  bool reshuffle_each_epoch_;
  int64_t epoch_ = 0;
  std::vector<int64_t> indices_;
  std::unique_ptr<data::BatchLoader> loader_;
};

}  // namespace harness::data_parallel
