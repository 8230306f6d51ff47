// One training epoch, validation loss and greedy generation (SPEC §3, §7).
#include "harness/train/run/trainer.h"

#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "harness/trace.h"
#include "harness/train/run/report.h"
#include "harness/train/setup.h"

namespace harness::train {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double EpochTiming::mean_batch_token_rate() const { return mean_std(batch_token_rates).mean; }

Progress::Progress(std::string description, int64_t total, bool enabled)
    : description_(std::move(description)),
      total_(total),
      enabled_(enabled),
      tty_(isatty(STDERR_FILENO) != 0),
      every_(std::max<int64_t>(1, total / 10)),
      start_(now_seconds()) {}

void Progress::update(int64_t done, const std::string& postfix) {
  if (!enabled_) return;
  const double elapsed = now_seconds() - start_;
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : 0;
    std::fprintf(stderr, "\r%s [%s%s] %lld/%lld %.1fs %s", description_.c_str(),
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), elapsed,
                 postfix.c_str());
    std::fflush(stderr);
  } else if (done % every_ == 0 || done == total_) {
    std::fprintf(stderr, "%s %lld/%lld %.1fs %s\n", description_.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), elapsed,
                 postfix.c_str());
  }
}

void Progress::finish() {
  if (enabled_ && tty_) std::fprintf(stderr, "\n");
}

int64_t batches_in_epoch(const data::BatchLoader& loader, int64_t max_batches) {
  return max_batches > 0 ? std::min(max_batches, loader.num_batches()) : loader.num_batches();
}

EpochTiming train_epoch(TrainStep& step, data::BatchLoader& loader, int64_t epoch,
                        const TrainEpochOptions& options, const EpochTiming& resumed) {
  step.set_training(true);
  EpochTiming timing = resumed;
  timing.batches = options.first_batch;
  const int64_t total = batches_in_epoch(loader, options.max_batches);
  Progress progress(options.description, total, options.show_progress);
  const double epoch_start = now_seconds();
  loader.start_epoch(epoch, std::min(options.first_batch, loader.num_batches()));
  const c10::Device device = step.input_device();
  if (options.accumulation_steps < 1) {
    throw std::invalid_argument("--gradient_accumulation_steps must be at least 1, got " +
                                std::to_string(options.accumulation_steps));
  }
  while (timing.batches < total) {
    std::vector<data::Batch> batches;
    int64_t tokens = 0;
    while (static_cast<int64_t>(batches.size()) < options.accumulation_steps &&
           timing.batches + static_cast<int64_t>(batches.size()) < total) {
      std::optional<data::Batch> batch = loader.next();
      if (!batch) break;
      tokens += batch->tokens();
      batches.push_back(std::move(*batch));
    }
    if (batches.empty()) break;
    if (options.before_step) options.before_step();
    const double t0 = now_seconds();
    {
      TraceScope scope(options.tracer, "step", options.trace_track,
                       {{"epoch", epoch}, {"batch", timing.batches}});
      for (data::Batch& batch : batches) batch = batch.to(device);
      timing.last_loss = step.step(batches);
    }
    const double batch_seconds = now_seconds() - t0;
    timing.tokens += tokens;
    timing.batch_token_rates.push_back(static_cast<double>(tokens) / batch_seconds);
    timing.batches += static_cast<int64_t>(batches.size());
    timing.last_step_seconds = batch_seconds;
    timing.last_step_tokens = tokens;
    std::ostringstream postfix;
    postfix << "loss=" << timing.last_loss << " lr=" << step.learning_rate()
            << " tokens_per_sec=" << static_cast<int64_t>(tokens / batch_seconds);
    progress.update(timing.batches, postfix.str());
    if (options.after_step) {
      const double paused = now_seconds();
      EpochTiming so_far = timing;
      so_far.seconds += paused - epoch_start;
      options.after_step(so_far);
      // A checkpoint written here is not training time.
      timing.seconds -= now_seconds() - paused;
    }
  }
  progress.finish();
  timing.seconds += now_seconds() - epoch_start;
  return timing;
}

double evaluate_loss_with(const BatchLoss& loss, data::BatchLoader& loader, int64_t max_batches) {
  torch::NoGradGuard no_grad;
  loader.start_epoch(0);
  double sum = 0.0;
  int64_t count = 0;
  while (max_batches == 0 || count < max_batches) {
    std::optional<data::Batch> batch = loader.next();
    if (!batch) break;
    sum += loss(*batch);
    ++count;
  }
  if (count == 0) throw std::runtime_error("evaluate_loss: the validation loader gave no batch");
  return sum / static_cast<double>(count);
}

double evaluate_loss(model::GPT2LMHeadModel& model, data::BatchLoader& loader,
                     const c10::Device& device, int64_t max_batches) {
  model->eval();
  const BatchLoss loss = [&](const data::Batch& batch) {
    data::Batch on_device = batch.to(device);
    return model->loss(on_device.input_ids, on_device.labels, on_device.label_token_weights).item<double>();
  };
  return evaluate_loss_with(loss, loader, max_batches);
}

int64_t greedy_choice(const torch::Tensor& logits, int64_t vocabulary) {
  // Rows of the head past the tokenizer's ids (a model vocabulary larger than the tokenizer's) are
  // never chosen: they have no text.
  return logits.index({0, -1}).narrow(0, 0, vocabulary).argmax().item<int64_t>();
}

namespace {

// One model's next token: its cached forward and greedy pick (over the vocabulary's slices when
// the head is split).
NextToken next_token_of(model::GPT2LMHeadModel& model, int64_t vocabulary) {
  return [&model, vocabulary](const torch::Tensor& new_ids, model::KVCache& cache) {
    return model->next_token(new_ids, cache, vocabulary);
  };
}

}  // namespace

std::vector<int64_t> greedy_continuation(const NextToken& next_token, const std::vector<int64_t>& prompt,
                                         int64_t model_max_length, int64_t stop_id, const c10::Device& device) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> ids = prompt;
  model::KVCache cache;
  torch::Tensor step_input = torch::tensor(ids, torch::kLong).unsqueeze(0).to(device);
  while (static_cast<int64_t>(ids.size()) <= model_max_length) {
    const int64_t next = next_token(step_input, cache);
    if (next == stop_id) break;
    ids.push_back(next);
    step_input = torch::full({1, 1}, next, torch::TensorOptions().dtype(torch::kLong).device(device));
  }
  return std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(prompt.size()), ids.end());
}

std::vector<int64_t> greedy_continuation(model::GPT2LMHeadModel& model, const std::vector<int64_t>& prompt,
                                         int64_t model_max_length, int64_t stop_id, int64_t vocabulary,
                                         const c10::Device& device) {
  if (vocabulary < 1 || vocabulary > model->config().vocab_size) {
    throw std::invalid_argument("greedy_continuation: the tokenizer's " + std::to_string(vocabulary) +
                                " ids do not fit the model's vocab_size " +
                                std::to_string(model->config().vocab_size));
  }
  return greedy_continuation(next_token_of(model, vocabulary), prompt, model_max_length, stop_id, device);
}

std::vector<std::string> generate_translations(model::GPT2LMHeadModel& model,
                                               const data::Tokenizer& tokenizer,
                                               const std::vector<data::TranslationExample>& examples,
                                               int64_t model_max_length, const c10::Device& device,
                                               bool show_progress) {
  check_positions(model->config(), model_max_length);
  if (tokenizer.vocab_size() < 1 || tokenizer.vocab_size() > model->config().vocab_size) {
    throw std::invalid_argument("generate_translations: the tokenizer's " + std::to_string(tokenizer.vocab_size()) +
                                " ids do not fit the model's vocab_size " +
                                std::to_string(model->config().vocab_size));
  }
  model->eval();
  return generate_translations_with(next_token_of(model, tokenizer.vocab_size()), tokenizer, examples, model_max_length,
                                    device, show_progress);
}

std::vector<std::string> generate_translations_with(const NextToken& next_token, const data::Tokenizer& tokenizer,
                                                    const std::vector<data::TranslationExample>& examples,
                                                    int64_t model_max_length, const c10::Device& device,
                                                    bool show_progress) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> generations;
  generations.reserve(examples.size());
  Progress progress("generate", static_cast<int64_t>(examples.size()), show_progress);
  for (const data::TranslationExample& example : examples) {
    const std::vector<int64_t> prompt = tokenizer.encode(example.de + data::Tokenizer::kEosDe);
    generations.push_back(tokenizer.decode(
        greedy_continuation(next_token, prompt, model_max_length, tokenizer.eos_en_id(), device)));
    progress.update(static_cast<int64_t>(generations.size()), "");
  }
  progress.finish();
  return generations;
}

}  // namespace harness::train
