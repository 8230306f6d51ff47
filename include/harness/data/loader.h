// Iterates over a list of examples in batches, optionally shuffled with a seed per epoch,
// collating on a background thread a few batches ahead so tokenization never stalls training.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "harness/data/collate.h"
#include "harness/data/example.h"

namespace harness::data {

using CollateFn = std::function<Batch(const std::vector<TranslationExample>&)>;

struct LoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = false;
  uint64_t seed = 0;       // with shuffle: the order of epoch e is fixed by (seed, e)
  bool drop_last = false;  // drop a final batch smaller than batch_size
  int prefetch = 2;        // batches collated ahead on the background thread (0: inline)
};

class BatchLoader {
 public:
  BatchLoader(std::vector<TranslationExample> examples, CollateFn collate, LoaderOptions options);
  ~BatchLoader();  // stops and joins the background thread
  BatchLoader(BatchLoader&&) noexcept;
  BatchLoader& operator=(BatchLoader&&) noexcept;

  // Starts an epoch (restarting any epoch under way). Then next() until it returns nullopt.
  // first_batch > 0 skips that many batches of the epoch's order without collating them (a
  // training run resumed inside an epoch continues with exactly the batches it had left).
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  std::optional<Batch> next();  // rethrows a collate error here, on the caller's thread

  int64_t num_batches() const;
  int64_t batch_size() const;
  const std::vector<TranslationExample>& examples() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace harness::data
