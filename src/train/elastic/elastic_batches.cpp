// The batches of an elastic generation's member (see elastic_batches.h).
#include "harness/train/elastic/elastic_batches.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "harness/train/loss.h"

namespace harness::train {
namespace {

// Rows [begin, end) of `batch`.
data::Batch rows_of(const data::Batch& batch, int64_t begin, int64_t end) {
  if (begin == 0 && end == batch.input_ids.size(0)) return batch;
  data::Batch out;
  out.input_ids = batch.input_ids.slice(0, begin, end);
  out.labels = batch.labels.slice(0, begin, end);
  out.label_token_weights = batch.label_token_weights.slice(0, begin, end);
  if (static_cast<int64_t>(batch.examples.size()) == batch.input_ids.size(0)) {
    out.examples.assign(batch.examples.begin() + begin, batch.examples.begin() + end);
  }
  return out;
}

}  // namespace

ElasticStepBatches elastic_step_batches(const parallel::Membership& membership,
                                        const std::vector<parallel::RowSlice>& slices,
                                        const std::vector<std::vector<data::Batch>>& replica_batches) {
  if (static_cast<int>(replica_batches.size()) != membership.original_replicas) {
    throw std::invalid_argument("elastic: batches of " + std::to_string(replica_batches.size()) +
                                " replicas given, the run has " + std::to_string(membership.original_replicas));
  }
  ElasticStepBatches out;
  for (const parallel::RowSlice& slice : slices) {
    const std::vector<data::Batch>& step = replica_batches.at(slice.replica);
    int64_t rows = 0;
    for (const data::Batch& b : step) rows += b.input_ids.size(0);
    const std::string which = "elastic: replica " + std::to_string(slice.replica);
    if (slice.begin < 0 || slice.end > rows || slice.begin >= slice.end) {
      throw std::invalid_argument(which + "'s rows [" + std::to_string(slice.begin) + ", " + std::to_string(slice.end) +
                                  ") are not within its step's " + std::to_string(rows));
    }
    // The label weight the replica's own step divides by (train/loss.h), in the same float sum.
    double weight = 0.0;
    try {
      weight = combined_label_weight(step, torch::kCPU).item<double>();
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(which + "'s step: " + e.what());
    }
    int64_t offset = 0;
    for (const data::Batch& b : step) {
      const int64_t n = b.input_ids.size(0);
      const int64_t begin = std::max(slice.begin, offset), end = std::min(slice.end, offset + n);
      if (begin < end) {
        out.batches.push_back(rows_of(b, begin - offset, end - offset));
        out.loss_divisors.push_back(weight / membership.gradient_scale());
      }
      offset += n;
    }
  }
  return out;
}

}  // namespace harness::train
