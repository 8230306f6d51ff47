// BatchLoader: order, shuffle determinism, drop_last, prefetch, restart, errors, shutdown.
#include "harness/data/loader.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>

namespace harness::data {
namespace {

std::vector<TranslationExample> numbered(int n) {
  std::vector<TranslationExample> examples;
  for (int i = 0; i < n; ++i) examples.push_back({std::to_string(i), "en" + std::to_string(i)});
  return examples;
}

// A collate that records the example numbers in input_ids (no tokenizer needed).
Batch number_collate(const std::vector<TranslationExample>& examples) {
  Batch batch;
  std::vector<int64_t> ids;
  for (const auto& example : examples) ids.push_back(std::stoll(example.de));
  batch.input_ids = torch::tensor(ids, torch::kInt64).unsqueeze(1);
  batch.examples = examples;
  return batch;
}

std::vector<std::vector<int64_t>> run_epoch(BatchLoader& loader, int64_t epoch) {
  loader.start_epoch(epoch);
  std::vector<std::vector<int64_t>> batches;
  while (auto batch = loader.next()) {
    const at::Tensor ids = batch->input_ids.flatten().contiguous();
    batches.emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  }
  return batches;
}

TEST(LoaderTest, InOrderWithoutShuffleWithAndWithoutPrefetch) {
  for (int prefetch : {0, 1, 3}) {
    BatchLoader loader(numbered(10), number_collate, LoaderOptions{4, false, 0, false, prefetch});
    EXPECT_EQ(loader.num_batches(), 3);
    EXPECT_EQ(loader.batch_size(), 4);
    const auto batches = run_epoch(loader, 0);
    EXPECT_EQ(batches, (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}))
        << "prefetch " << prefetch;
    EXPECT_FALSE(loader.next().has_value());  // stays exhausted
  }
}

// A run resumed inside an epoch skips the batches it had trained: the rest are exactly the
// uninterrupted epoch's, in order, and the skipped ones are never collated.
TEST(LoaderTest, StartingAtABatchGivesTheRestOfThatEpochsOrder) {
  for (int prefetch : {0, 2}) {
    std::atomic<int> collated{0};
    BatchLoader loader(numbered(23), [&](const std::vector<TranslationExample>& ex) {
      ++collated;
      return number_collate(ex);
    }, {4, true, 9, false, prefetch});
    const auto whole = run_epoch(loader, 3);
    ASSERT_EQ(whole.size(), 6u);
    collated = 0;
    loader.start_epoch(3, 4);
    std::vector<std::vector<int64_t>> rest;
    while (auto batch = loader.next()) {
      const at::Tensor ids = batch->input_ids.flatten().contiguous();
      rest.emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
    }
    EXPECT_EQ(rest, std::vector<std::vector<int64_t>>(whole.begin() + 4, whole.end())) << prefetch;
    EXPECT_EQ(collated.load(), 2) << prefetch;
    loader.start_epoch(3, 6);
    EXPECT_FALSE(loader.next().has_value());
    EXPECT_THROW(loader.start_epoch(3, 7), std::invalid_argument);
    EXPECT_THROW(loader.start_epoch(3, -1), std::invalid_argument);
  }
}

TEST(LoaderTest, DropLastDropsTheShortBatch) {
  BatchLoader loader(numbered(10), number_collate, LoaderOptions{4, false, 0, true, 2});
  EXPECT_EQ(loader.num_batches(), 2);
  EXPECT_EQ(run_epoch(loader, 0).size(), 2u);
}

TEST(LoaderTest, ShuffleIsAPermutationFixedBySeedAndEpoch) {
  BatchLoader a(numbered(50), number_collate, LoaderOptions{8, true, 42, false, 2});
  BatchLoader b(numbered(50), number_collate, LoaderOptions{8, true, 42, false, 0});
  BatchLoader c(numbered(50), number_collate, LoaderOptions{8, true, 43, false, 2});
  const auto a0 = run_epoch(a, 0), a1 = run_epoch(a, 1);
  EXPECT_EQ(a0, run_epoch(b, 0));  // prefetching does not change the order
  EXPECT_EQ(a1, run_epoch(b, 1));
  EXPECT_EQ(a0, run_epoch(a, 0));  // the same epoch again
  EXPECT_NE(a0, a1);
  EXPECT_NE(a0, run_epoch(c, 0));
  std::multiset<int64_t> seen;
  for (const auto& batch : a0) seen.insert(batch.begin(), batch.end());
  std::multiset<int64_t> all;
  for (int i = 0; i < 50; ++i) all.insert(i);
  EXPECT_EQ(seen, all);
  std::vector<int64_t> flat;
  for (const auto& batch : a0) flat.insert(flat.end(), batch.begin(), batch.end());
  EXPECT_FALSE(std::is_sorted(flat.begin(), flat.end()));
}

TEST(LoaderTest, PrefetchRunsAheadButBoundedAndInBackground) {
  std::atomic<int> collated{0};
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> on_caller_thread{false};
  CollateFn counting = [&](const std::vector<TranslationExample>& examples) {
    if (std::this_thread::get_id() == caller) on_caller_thread = true;
    ++collated;
    return number_collate(examples);
  };
  BatchLoader loader(numbered(20), counting, LoaderOptions{2, false, 0, false, 3});
  loader.start_epoch(0);
  for (int i = 0; i < 2000 && collated < 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // 3 queued + 1 collated and waiting for room: never more before the first next().
  EXPECT_GE(collated.load(), 3);
  EXPECT_LE(collated.load(), 4);
  ASSERT_TRUE(loader.next().has_value());
  EXPECT_FALSE(on_caller_thread.load());
}

TEST(LoaderTest, CollateErrorIsRethrownOnTheCallersThreadInOrder) {
  CollateFn failing = [](const std::vector<TranslationExample>& examples) {
    if (examples.front().de == "4") throw std::runtime_error("cannot collate example 4");
    return number_collate(examples);
  };
  for (int prefetch : {0, 2}) {
    BatchLoader loader(numbered(10), failing, LoaderOptions{2, false, 0, false, prefetch});
    loader.start_epoch(0);
    ASSERT_TRUE(loader.next().has_value());
    ASSERT_TRUE(loader.next().has_value());
    try {
      loader.next();
      FAIL() << "expected the collate error, prefetch " << prefetch;
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "cannot collate example 4");
    }
    // A new epoch starts cleanly after the error.
    loader.start_epoch(1);
    ASSERT_TRUE(loader.next().has_value());
  }
}

TEST(LoaderTest, RestartMidEpochAndDestroyMidEpochDoNotHang) {
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 20; ++round) {
    BatchLoader loader(numbered(100), number_collate, LoaderOptions{3, true, 5, false, 2});
    loader.start_epoch(0);
    loader.next();
    loader.start_epoch(0);  // restart while the producer is blocked on a full queue
    const auto first = loader.next();
    ASSERT_TRUE(first.has_value());
    loader.start_epoch(0);
    EXPECT_TRUE(torch::equal(loader.next()->input_ids, first->input_ids));
    // destroyed here with the producer waiting
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(LoaderTest, MoveKeepsTheEpochAndBadOptionsAreErrors) {
  BatchLoader loader(numbered(6), number_collate, LoaderOptions{2, false, 0, false, 2});
  loader.start_epoch(0);
  ASSERT_TRUE(loader.next().has_value());
  BatchLoader moved(std::move(loader));
  auto second = moved.next();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->input_ids[0][0].item<int64_t>(), 2);
  EXPECT_EQ(moved.examples().size(), 6u);

  EXPECT_THROW(BatchLoader(numbered(3), number_collate, LoaderOptions{0}), std::invalid_argument);
  EXPECT_THROW(BatchLoader(numbered(3), number_collate, LoaderOptions{1, false, 0, false, -1}),
               std::invalid_argument);
  BatchLoader not_started(numbered(3), number_collate, LoaderOptions{});
  EXPECT_THROW(not_started.next(), std::logic_error);
}

}  // namespace
}  // namespace harness::data
