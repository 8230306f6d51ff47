// What both programs do before training: the corpus (a dataset folder or the embedded one), the
// tokenizer (trained on the training pairs, or the one shipped with a loaded model), and the model
// (a preset or a Hugging Face folder), each checked against the others.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "harness/data/dataset.h"
#include "harness/data/example.h"
#include "harness/data/tokenizer.h"
#include "harness/model/gpt2.h"

namespace harness::train {

struct ModelSource {
  std::string preset = "gpt2-mini";  // used when path is empty
  std::string path;                  // folder with config.json + model.safetensors
  std::optional<double> dropout;     // overrides embd/attn/resid_pdrop when set
};

// `dataset` empty: the embedded corpus generated from `seed`. With sizes_given (train,
// validation, test), a split of `dataset` with fewer pairs than its given size is an
// std::invalid_argument naming the dataset, the split, both numbers and the flag.
data::TranslationCorpus load_corpus(const std::string& dataset, const data::SplitSizes& sizes,
                                    uint64_t seed, const bool* sizes_given = nullptr);

// The config the model will have (preset or path/config.json, then the dropout override).
model::GPT2Config resolve_config(const ModelSource& source);

// --model_max_length against the model's positions: training feeds model_max_length tokens, and
// so does greedy generation at most (it stops once the sequence is longer than model_max_length,
// and the token appended last is never fed back), so every mode needs n_positions >=
// model_max_length. The error names both values and what to pass.
void check_positions(const model::GPT2Config& config, int64_t model_max_length);

// The tokenizer.model shipped in source.path, if any: loaded and checked against config's
// vocab_size (an error names the file and both sizes). Empty when there is none.
std::optional<data::Tokenizer> shipped_tokenizer(const ModelSource& source, const model::GPT2Config& config);

// A tokenizer.model beside the loaded weights is reused (so that a trained model can be evaluated
// as it is); otherwise a new one is trained on corpus.train, capped at config.vocab_size, and saved
// as `save_path`. Throws when the model's vocab_size is smaller than the tokenizer's.
data::Tokenizer prepare_tokenizer(const ModelSource& source, const model::GPT2Config& config,
                                  const std::vector<data::TranslationExample>& train,
                                  const std::string& save_path);

// --fit_vocab: a model initialised from scratch gets exactly the tokenizer's vocabulary (the
// preset's vocab_size is only the cap). A model loaded from source.path keeps its own: its rows
// are trained weights; a note on stderr says so.
void fit_vocabulary(model::GPT2Config& config, const ModelSource& source,
                    const data::Tokenizer& tokenizer);

// A model of `config` with the weights of source.path, else freshly initialised from torch's
// seed `seed`; split over `tp` when given (each rank reads its own slices of the weights).
model::GPT2LMHeadModel build_model(const ModelSource& source, const model::GPT2Config& config,
                                   uint64_t seed, std::shared_ptr<model::TensorParallelGroup> tp = nullptr);

// Creates the folder (and parents); an error names it.
void make_directories(const std::string& path);

// Creates the folder and proves that a file can be written there (and removed): an
// std::invalid_argument names `flag`, the folder and the reason, before any work is done.
void check_writable_folder(const std::string& path, const std::string& flag);

}  // namespace harness::train
