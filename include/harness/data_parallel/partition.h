// Splitting a dataset across data-parallel ranks as the original does: shuffle 0..n-1 with
// CPython's random.Random(seed), then cut consecutive slices of int(size * n) indices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/data/example.h"
#include "harness/data/loader.h"

namespace harness::data_parallel {

constexpr uint64_t kDefaultPartitionSeed = 1234;

// The index plan alone (pure): slice i holds int(sizes[i] * n) indices of the shuffled range.
// Throws std::invalid_argument for a negative size or sizes summing to more than 1 (+1e-9).
std::vector<std::vector<int64_t>> partition_indices(int64_t n, const std::vector<double>& sizes,
                                                    uint64_t seed = kDefaultPartitionSeed);

// Epoch-wise resharding, as PyTorch's DistributedSampler.set_epoch: epoch e shuffles with seed
// + e, so epoch 0 is the original's order and every rank derives the same permutation without
// communicating. Throws std::invalid_argument for a negative epoch.
uint64_t epoch_seed(uint64_t seed, int64_t epoch);

// A view of `data` at `indices` (the data is shared, never copied).
template <typename T>
class Partition {
 public:
  Partition(std::shared_ptr<const std::vector<T>> data, std::vector<int64_t> indices)
      : data_(std::move(data)), indices_(std::move(indices)) {}

  size_t size() const { return indices_.size(); }
  const T& operator[](size_t i) const { return (*data_)[static_cast<size_t>(indices_[i])]; }
  const T& at(size_t i) const {
    if (i >= indices_.size()) {
      throw std::out_of_range("Partition::at(" + std::to_string(i) + "): the partition has " +
                              std::to_string(indices_.size()) + " elements");
    }
    return (*this)[i];
  }
  const std::vector<int64_t>& indices() const { return indices_; }
  // The elements in partition order, copied (what a loader consumes).
  std::vector<T> to_vector() const {
    std::vector<T> out;
    out.reserve(indices_.size());
    for (int64_t index : indices_) out.push_back((*data_)[static_cast<size_t>(index)]);
    return out;
  }

 private:
  std::shared_ptr<const std::vector<T>> data_;
  std::vector<int64_t> indices_;
};

template <typename T>
class DataPartitioner {
 public:
  DataPartitioner(std::vector<T> data, std::vector<double> sizes = {0.7, 0.2, 0.1},
                  uint64_t seed = kDefaultPartitionSeed)
      : data_(std::make_shared<const std::vector<T>>(std::move(data))),
        sizes_(std::move(sizes)),
        seed_(seed),
        partitions_(partition_indices(static_cast<int64_t>(data_->size()), sizes_, seed_)) {}

  // Reshuffles for `epoch` (seed + epoch, see epoch_seed): the partitions stay disjoint and of
  // the same sizes, their members change. Epoch 0 restores the original's partitions.
  void set_epoch(int64_t epoch) {
    partitions_ = partition_indices(static_cast<int64_t>(data_->size()), sizes_,
                                    epoch_seed(seed_, epoch));
    epoch_ = epoch;
  }
  int64_t epoch() const { return epoch_; }

  size_t num_partitions() const { return partitions_.size(); }
  Partition<T> use(size_t i) const {
    if (i >= partitions_.size()) {
      throw std::out_of_range("DataPartitioner::use(" + std::to_string(i) + "): there are " +
                              std::to_string(partitions_.size()) + " partitions");
    }
    return Partition<T>(data_, partitions_[i]);
  }

 private:
  std::shared_ptr<const std::vector<T>> data_;
  std::vector<double> sizes_;
  uint64_t seed_;
  int64_t epoch_ = 0;
  std::vector<std::vector<int64_t>> partitions_;
};

// Per-device batch size batch_size / world_size; world_size equal fractions (1 / world_size each);
// a loader over partition `rank`, in partition order (no shuffle), of the partitions of `epoch`
// (0: the original's; see epoch_seed and ShardedLoader in sharded_loader.h). Errors name the
// flags: "--batch_size 100 is not divisible by --world_size 3", a rank outside [0, world_size).
int64_t per_device_batch_size(int64_t batch_size, int world_size);
data::BatchLoader partition_dataset(int rank, int world_size,
                                    const std::vector<data::TranslationExample>& dataset,
                                    int64_t batch_size, data::CollateFn collate,
                                    uint64_t seed = kDefaultPartitionSeed, int64_t epoch = 0);

}  // namespace harness::data_parallel
