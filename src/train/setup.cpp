// Corpus, tokenizer and model set-up shared by the programs.
#include "harness/train/setup.h"

#include <torch/torch.h>

#include <filesystem>
#include <iostream>

#include "harness/data/synthetic_corpus.h"
#include "harness/model/safetensors.h"

namespace harness::train {

namespace fs = std::filesystem;

data::TranslationCorpus load_corpus(const std::string& dataset, const data::SplitSizes& sizes,
                                    uint64_t seed) {
  if (dataset.empty()) return data::generate_corpus(seed, sizes);
  return data::load_dataset(dataset, sizes);
}

model::GPT2Config resolve_config(const ModelSource& source) {
  if (source.path.empty()) return model::GPT2Config::preset(source.preset);
  const fs::path config = fs::path(source.path) / "config.json";
  if (!fs::exists(config)) {
    throw std::runtime_error("--model_path " + source.path + ": no config.json in that folder");
  }
  return model::GPT2Config::from_json_file(config.string());
}

data::Tokenizer prepare_tokenizer(const ModelSource& source, const model::GPT2Config& config,
                                  const std::vector<data::TranslationExample>& train,
                                  const std::string& save_path) {
  std::optional<data::Tokenizer> tokenizer;
  const fs::path shipped = source.path.empty() ? fs::path() : fs::path(source.path) / "tokenizer.model";
  if (!shipped.empty() && fs::exists(shipped)) {
    std::cerr << "tokenizer: using " << shipped.string() << " shipped with the model\n";
    tokenizer.emplace(data::Tokenizer::load(shipped.string()));
    if (fs::absolute(shipped) != fs::absolute(save_path)) {
      fs::copy_file(shipped, save_path, fs::copy_options::overwrite_existing);
    }
  } else {
    tokenizer.emplace(data::Tokenizer::train(train, config.vocab_size, save_path));
  }
  if (config.vocab_size < tokenizer->vocab_size()) {
    throw std::runtime_error("the model's vocab_size " + std::to_string(config.vocab_size) +
                             " is smaller than the tokenizer's " +
                             std::to_string(tokenizer->vocab_size()) + " pieces");
  }
  return std::move(*tokenizer);
}

model::GPT2LMHeadModel build_model(const ModelSource& source, const model::GPT2Config& config,
                                   uint64_t seed) {
  torch::manual_seed(seed);
  if (!source.path.empty()) return model::from_pretrained(source.path);
  model::GPT2LMHeadModel model(config);
  model->reset_parameters();
  return model;
}

void make_directories(const std::string& path) {
  std::error_code error;
  fs::create_directories(path, error);
  if (error) throw std::runtime_error("cannot create folder " + path + ": " + error.message());
}

}  // namespace harness::train
