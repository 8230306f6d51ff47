// The index plan of DataPartitioner (see partition.h).
#include "harness/data_parallel/partition.h"

#include <cmath>
#include <numeric>
#include <sstream>

#include "harness/data_parallel/py_random.h"

namespace harness::data_parallel {

std::vector<std::vector<int64_t>> partition_indices(int64_t n, const std::vector<double>& sizes,
                                                    uint64_t seed) {
  if (n < 0) throw std::invalid_argument("partition_indices: n = " + std::to_string(n) + " < 0");
  double total = 0.0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!(sizes[i] >= 0.0) || !std::isfinite(sizes[i])) {
      std::ostringstream msg;
      msg << "DataPartitioner: size " << i << " is " << sizes[i]
          << "; partition sizes must be fractions in [0, 1]";
      throw std::invalid_argument(msg.str());
    }
    total += sizes[i];
  }
  if (total > 1.0 + 1e-9) {
    std::ostringstream msg;
    msg.precision(17);
    msg << "DataPartitioner: partition sizes sum to " << total
        << ", more than 1; the partitions would overlap";
    throw std::invalid_argument(msg.str());
  }

  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  PyRandom::from_unsigned(seed).shuffle(order);

  std::vector<std::vector<int64_t>> partitions;
  partitions.reserve(sizes.size());
  size_t begin = 0;
  for (double fraction : sizes) {
    // Python's int(frac * data_len): the same double product, truncated; the tolerance above
    // may let the last slice ask for more than remains, so clamp as Python's slicing does.
    const auto want = static_cast<size_t>(fraction * static_cast<double>(n));
    const size_t end = std::min(order.size(), begin + want);
    partitions.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(begin),
                            order.begin() + static_cast<std::ptrdiff_t>(end));
    begin = end;
  }
  return partitions;
}

uint64_t epoch_seed(uint64_t seed, int64_t epoch) {
  if (epoch < 0) {
    throw std::invalid_argument("epoch_seed: epoch " + std::to_string(epoch) + " is negative");
  }
  return seed + static_cast<uint64_t>(epoch);
}

int64_t per_device_batch_size(int64_t batch_size, int world_size) {
  if (world_size < 1) {
    throw std::invalid_argument("--world_size " + std::to_string(world_size) +
                                " must be at least 1");
  }
  if (batch_size < 1) {
    throw std::invalid_argument("--batch_size " + std::to_string(batch_size) +
                                " must be at least 1");
  }
  if (batch_size % world_size != 0) {
    throw std::invalid_argument("--batch_size " + std::to_string(batch_size) +
                                " is not divisible by --world_size " + std::to_string(world_size));
  }
  return batch_size / world_size;
}

}  // namespace harness::data_parallel
