// The single-device pieces every program shares: one training epoch (with a hook between backward
// and the optimizer step, where data parallelism synchronises gradients), validation loss, and
// greedy generation with a key/value cache.
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

namespace torch::optim {
class Optimizer;
}
namespace harness {
class Tracer;
}

namespace harness::train {

struct TrainEpochOptions {
  c10::Device device = c10::Device(c10::kCPU);  // where batches go (the model's first device)
  int64_t max_batches = 0;                      // 0: the whole epoch
  std::function<void()> after_backward;         // e.g. gradient averaging; may be empty
  std::string description = "train";            // progress label
  bool show_progress = true;
  Tracer* tracer = nullptr;
  std::string trace_track = "main";
};

struct EpochTiming {
  double seconds = 0.0;                   // wall time of the whole epoch
  std::vector<double> batch_token_rates;  // tokens / seconds of each batch
  int64_t tokens = 0;                     // sum over batches of B * T of input_ids
  int64_t batches = 0;
  double last_loss = 0.0;
  double mean_batch_token_rate() const;
};

EpochTiming train_epoch(model::GPT2LMHeadModel& model, torch::optim::Optimizer& optimizer,
                        data::BatchLoader& loader, int64_t epoch, const TrainEpochOptions& options);

// The same for any model that maps input_ids [B, T] to logits [B, T, V] (e.g. a tensor-parallel
// GPT-2); `module` is what train() is called on.
using LogitsFn = std::function<at::Tensor(const at::Tensor& input_ids)>;
EpochTiming train_epoch(torch::nn::Module& module, const LogitsFn& forward,
                        torch::optim::Optimizer& optimizer, data::BatchLoader& loader,
                        int64_t epoch, const TrainEpochOptions& options);

// Mean over batches of SPEC §3's weighted loss, without gradients, in eval mode.
double evaluate_loss(model::GPT2LMHeadModel& model, data::BatchLoader& loader,
                     const c10::Device& device, int64_t max_batches = 0);

// Greedy generation of SPEC §3 for each example's de side: start from encode(de + <eos_de>),
// append the arg-max token while the sequence has at most model_max_length tokens, stop at
// <eos_en>. Returns the decoded continuations. One position per new token (KV cache).
std::vector<std::string> generate_translations(model::GPT2LMHeadModel& model,
                                               const data::Tokenizer& tokenizer,
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
