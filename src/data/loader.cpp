// BatchLoader: the epoch's order (shuffled from (seed, epoch) with splitmix64 and Fisher-Yates),
// and a producer thread that collates up to `prefetch` batches ahead into a bounded queue.
#include "harness/data/loader.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>

namespace harness::data {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<size_t> epoch_order(size_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  if (!shuffle) return order;
  uint64_t state = seed;
  state = splitmix64(state) ^ (static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ull);
  for (size_t i = n; i > 1; --i) {
    const size_t j = static_cast<size_t>(splitmix64(state) % i);
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace

struct BatchLoader::State {
  std::vector<TranslationExample> examples;
  CollateFn collate;
  LoaderOptions options;

  std::vector<size_t> order;  // this epoch's example order
  bool started = false;
  int64_t produced = 0;  // batches collated (inline mode: handed out)
  int64_t consumed = 0;  // batches handed out by next()

  // Producer/consumer state, guarded by mutex.
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Batch> ready;
  std::exception_ptr error;
  bool producer_done = false;
  bool stop = false;
  std::thread producer;

  int64_t num_batches() const {
    const int64_t n = static_cast<int64_t>(examples.size());
    const int64_t b = options.batch_size;
    return options.drop_last ? n / b : (n + b - 1) / b;
  }

  std::vector<TranslationExample> batch_examples(int64_t k) const {
    const size_t begin = static_cast<size_t>(k * options.batch_size);
    const size_t end = std::min(order.size(), begin + static_cast<size_t>(options.batch_size));
    std::vector<TranslationExample> rows;
    rows.reserve(end - begin);
    for (size_t i = begin; i < end; ++i) rows.push_back(examples[order[i]]);
    return rows;
  }

  void produce(int64_t first_batch) {
    const int64_t total = num_batches();
    for (int64_t k = first_batch; k < total; ++k) {
      Batch batch;
      try {
        batch = collate(batch_examples(k));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        error = std::current_exception();
        producer_done = true;
        changed.notify_all();
        return;
      }
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock, [&] { return stop || static_cast<int>(ready.size()) < options.prefetch; });
      if (stop) return;
      ready.push_back(std::move(batch));
      changed.notify_all();
    }
    std::lock_guard<std::mutex> lock(mutex);
    producer_done = true;
    changed.notify_all();
  }

  void stop_producer() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
      changed.notify_all();
    }
    if (producer.joinable()) producer.join();
    ready.clear();
    error = nullptr;
    producer_done = false;
    stop = false;
  }
};

BatchLoader::BatchLoader(std::vector<TranslationExample> examples, CollateFn collate,
                         LoaderOptions options)
    : state_(std::make_unique<State>()) {
  if (options.batch_size < 1) {
    throw std::invalid_argument("BatchLoader: batch_size must be at least 1, got " +
                                std::to_string(options.batch_size));
  }
  if (options.prefetch < 0) {
    throw std::invalid_argument("BatchLoader: prefetch must be >= 0, got " +
                                std::to_string(options.prefetch));
  }
  if (!collate) throw std::invalid_argument("BatchLoader: no collate function");
  state_->examples = std::move(examples);
  state_->collate = std::move(collate);
  state_->options = options;
}

BatchLoader::~BatchLoader() {
  if (state_) state_->stop_producer();
}

BatchLoader::BatchLoader(BatchLoader&&) noexcept = default;

BatchLoader& BatchLoader::operator=(BatchLoader&& other) noexcept {
  if (this != &other) {
    if (state_) state_->stop_producer();
    state_ = std::move(other.state_);
  }
  return *this;
}

void BatchLoader::start_epoch(int64_t epoch, int64_t first_batch) {
  if (!state_) throw std::logic_error("BatchLoader::start_epoch on a moved-from loader");
  State& s = *state_;
  if (first_batch < 0 || first_batch > s.num_batches()) {
    throw std::invalid_argument("BatchLoader::start_epoch: first batch " + std::to_string(first_batch) +
                                " is outside [0, " + std::to_string(s.num_batches()) + "]");
  }
  s.stop_producer();
  s.order = epoch_order(s.examples.size(), s.options.shuffle, s.options.seed, epoch);
  s.produced = first_batch;
  s.consumed = first_batch;
  s.started = true;
  if (s.options.prefetch > 0 && first_batch < s.num_batches()) {
    s.producer = std::thread([&s, first_batch] { s.produce(first_batch); });
  }
}

std::optional<Batch> BatchLoader::next() {
  if (!state_) throw std::logic_error("BatchLoader::next on a moved-from loader");
  State& s = *state_;
  if (!s.started) throw std::logic_error("BatchLoader::next called before start_epoch");
  if (s.consumed >= s.num_batches()) return std::nullopt;
  if (s.options.prefetch == 0) {
    Batch batch = s.collate(s.batch_examples(s.consumed));
    ++s.consumed;
    return batch;
  }
  std::unique_lock<std::mutex> lock(s.mutex);
  s.changed.wait(lock, [&] { return !s.ready.empty() || s.error || s.producer_done; });
  if (!s.ready.empty()) {
    Batch batch = std::move(s.ready.front());
    s.ready.pop_front();
    ++s.consumed;
    s.changed.notify_all();
    return batch;
  }
  if (s.error) {
    std::exception_ptr error = s.error;
    s.error = nullptr;
    s.consumed = s.num_batches();  // the epoch ends with the error
    std::rethrow_exception(error);
  }
  return std::nullopt;
}

int64_t BatchLoader::num_batches() const { return state_ ? state_->num_batches() : 0; }
int64_t BatchLoader::batch_size() const { return state_ ? state_->options.batch_size : 0; }
const std::vector<TranslationExample>& BatchLoader::examples() const {
  if (!state_) throw std::logic_error("BatchLoader::examples on a moved-from loader");
  return state_->examples;
}

}  // namespace harness::data
