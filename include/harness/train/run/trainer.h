// The pieces every layout shares: one training epoch of optimizer steps (train_step.h says what a
// step is for each layout), validation loss, and greedy generation with a key/value cache.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "harness/data/loader.h"
#include "harness/data/tokenizer.h"
#include "harness/model/gpt2.h"
#include "harness/train/step/train_step.h"

namespace harness {
class Tracer;
}

namespace harness::train {

// Seconds on the steady clock: what the epochs' and checkpoints' timings subtract.
double now_seconds();

struct EpochTiming;

struct TrainEpochOptions {
  int64_t max_batches = 0;                      // 0: the whole epoch
  int64_t first_batch = 0;                      // batches of this epoch already trained (resume)
  int64_t accumulation_steps = 1;               // batches per optimizer step (fewer at the epoch's end)
  std::string description = "train";            // progress label
  bool show_progress = true;
  Tracer* tracer = nullptr;
  std::string trace_track = "main";
  // Before each optimizer step (the learning rate of the step is set here).
  std::function<void()> before_step;
  // After each optimizer step, with the epoch's figures so far (checkpoints, evaluations, the
  // metrics log); its own time is not counted as training time.
  std::function<void(const EpochTiming& so_far)> after_step;
};

struct EpochTiming {
  double seconds = 0.0;                   // wall time of the epoch's batches
  std::vector<double> batch_token_rates;  // tokens / seconds of each optimizer step's batches
  int64_t tokens = 0;                     // sum over batches of B * T of input_ids
  int64_t batches = 0;                    // batches trained (the resumed part included)
  double last_loss = 0.0;                 // of the last optimizer step
  double last_step_seconds = 0.0;
  int64_t last_step_tokens = 0;
  double mean_batch_token_rate() const;
};

// The batches of one epoch, options.accumulation_steps of them per step of `step` (the last step
// of the epoch takes what is left), from options.first_batch up to max_batches (or the end). `resumed` holds the figures of the part of the epoch trained before a resume
// (first_batch batches); the result covers the whole epoch.
EpochTiming train_epoch(TrainStep& step, data::BatchLoader& loader, int64_t epoch,
                        const TrainEpochOptions& options, const EpochTiming& resumed = {});

// Batches of the epoch train_epoch will run: min(max_batches, loader's) (all when 0).
int64_t batches_in_epoch(const data::BatchLoader& loader, int64_t max_batches);

// One batch's SPEC §3 weighted loss, however the model runs (one model's forward, or a pipeline's
// stages, where only the last stage's rank computes it and the others return anything).
using BatchLoss = std::function<double(const data::Batch& batch)>;
// The one evaluation loop (as generate_translations_with is generation's): the mean of `loss` over
// `loader`'s batches from the start (the first max_batches of them; 0: all), without gradients.
// Throws std::runtime_error when the loader gives no batch.
double evaluate_loss_with(const BatchLoss& loss, data::BatchLoader& loader, int64_t max_batches = 0);
// Mean over batches of SPEC §3's weighted loss of `model` on `device`, in eval mode.
double evaluate_loss(model::GPT2LMHeadModel& model, data::BatchLoader& loader,
                     const c10::Device& device, int64_t max_batches = 0);

// The greedy continuation of `prompt` (SPEC §3): the arg-max over the first `vocabulary` ids
// (the tokenizer's; rows of a larger head are never chosen) appended while the sequence has at
// most model_max_length tokens, stopping at stop_id (not appended). One position per new token.
std::vector<int64_t> greedy_continuation(model::GPT2LMHeadModel& model, const std::vector<int64_t>& prompt,
                                         int64_t model_max_length, int64_t stop_id, int64_t vocabulary,
                                         const c10::Device& device);

// The greedy pick from logits [1, T, V]: the arg-max over the first `vocabulary` ids at the last
// position (rows of a larger head are never chosen).
int64_t greedy_choice(const torch::Tensor& logits, int64_t vocabulary);

// The same over any way of running the model: `next_token(new_ids [1, n], cache)` returns the
// arg-max id over the first `vocabulary` after the new ids, extending `cache` (one model's
// forward_cached, or a pipeline's stages, each keeping its own layers' cache).
using NextToken = std::function<int64_t(const torch::Tensor& new_ids, model::KVCache& cache)>;
std::vector<int64_t> greedy_continuation(const NextToken& next_token, const std::vector<int64_t>& prompt,
                                         int64_t model_max_length, int64_t stop_id, const c10::Device& device);

// Greedy generation of SPEC §3 for each example's de side: start from encode(de + <eos_de>),
// append the arg-max token while the sequence has at most model_max_length tokens, stop at
// <eos_en>. Returns the decoded continuations. One position per new token (KV cache).
std::vector<std::string> generate_translations(model::GPT2LMHeadModel& model,
                                               const data::Tokenizer& tokenizer,
                                               const std::vector<data::TranslationExample>& examples,
                                               int64_t model_max_length, const c10::Device& device,
                                               bool show_progress = true);
// The same with each continuation from greedy_continuation(next_token, ...) (a pipeline's stages).
std::vector<std::string> generate_translations_with(const NextToken& next_token, const data::Tokenizer& tokenizer,
                                                    const std::vector<data::TranslationExample>& examples,
                                                    int64_t model_max_length, const c10::Device& device,
                                                    bool show_progress = true);

// Progress on stderr: a bar redrawn in place on a terminal, else a plain line every few batches.
class Progress {
 public:
  Progress(std::string description, int64_t total, bool enabled);
  void update(int64_t done, const std::string& postfix);
  void finish();

 private:
  std::string description_;
  int64_t total_;
  bool enabled_, tty_;
  int64_t every_;
  double start_;
};

}  // namespace harness::train
