// ShardedLoader (see sharded_loader.h).
#include "harness/data_parallel/sharded_loader.h"

#include <stdexcept>
#include <string>

namespace harness::data_parallel {
namespace {

int checked_rank(int rank, int world_size) {
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is outside [0, --world_size " +
                                std::to_string(world_size) + ")");
  }
  return rank;
}

}  // namespace

ShardedLoader::ShardedLoader(int rank, int world_size,
                             std::vector<data::TranslationExample> dataset, int64_t batch_size,
                             data::CollateFn collate, uint64_t seed, bool reshuffle_each_epoch)
    : rank_(rank),
      world_size_(world_size),
      device_batch_size_(per_device_batch_size(batch_size, world_size)),
      partitioner_(std::move(dataset),
                   std::vector<double>(static_cast<size_t>(world_size), 1.0 / world_size), seed),
      collate_(std::move(collate)),
      reshuffle_each_epoch_(reshuffle_each_epoch) {
  checked_rank(rank_, world_size_);
  load(0);
}

data::BatchLoader& ShardedLoader::set_epoch(int64_t epoch) {
  if (epoch < 0) {
    throw std::invalid_argument("ShardedLoader::set_epoch: epoch " + std::to_string(epoch) +
                                " is negative");
  }
  if (reshuffle_each_epoch_ && epoch != epoch_) load(epoch);
  epoch_ = epoch;
  return *loader_;
}

void ShardedLoader::load(int64_t epoch) {
  partitioner_.set_epoch(epoch);
  const Partition<data::TranslationExample> partition = partitioner_.use(static_cast<size_t>(rank_));
  indices_ = partition.indices();
  data::LoaderOptions options;
  options.batch_size = device_batch_size_;
  options.shuffle = false;
  loader_.reset();  // stop the previous loader's prefetching before building the next
  loader_ = std::make_unique<data::BatchLoader>(partition.to_vector(), collate_, options);
}

}  // namespace harness::data_parallel
