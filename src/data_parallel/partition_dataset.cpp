// partition_dataset: the loader each data-parallel rank trains on (kept apart from partition.cpp
// so that the pure partitioning links without the data library's loader).
#include "harness/data_parallel/partition.h"

namespace harness::data_parallel {

data::BatchLoader partition_dataset(int rank, int world_size,
                                    const std::vector<data::TranslationExample>& dataset,
                                    int64_t batch_size, data::CollateFn collate, uint64_t seed,
                                    int64_t epoch) {
  const int64_t device_batch_size = per_device_batch_size(batch_size, world_size);
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is outside [0, --world_size " +
                                std::to_string(world_size) + ")");
  }
  const std::vector<double> sizes(static_cast<size_t>(world_size), 1.0 / world_size);
  DataPartitioner<data::TranslationExample> partitioner(dataset, sizes, seed);
  if (epoch != 0) partitioner.set_epoch(epoch);
  data::LoaderOptions options;
  options.batch_size = device_batch_size;
  options.shuffle = false;
  return data::BatchLoader(partitioner.use(static_cast<size_t>(rank)).to_vector(),
                           std::move(collate), options);
}

}  // namespace harness::data_parallel
