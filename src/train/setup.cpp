// Corpus, tokenizer and model set-up shared by the programs.
#include "harness/train/setup.h"

#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "harness/data/synthetic_corpus.h"
#include "harness/model/safetensors.h"

namespace harness::train {

namespace fs = std::filesystem;

data::TranslationCorpus load_corpus(const std::string& dataset, const data::SplitSizes& sizes,
                                    uint64_t seed, const bool* sizes_given) {
  if (dataset.empty()) return data::generate_corpus(seed, sizes);
  data::TranslationCorpus corpus = data::load_dataset(dataset, sizes);
  const size_t requested[] = {sizes.train, sizes.validation, sizes.test};
  const size_t found[] = {corpus.train.size(), corpus.validation.size(), corpus.test.size()};
  const char* names[] = {"training", "validation", "test"};
  const char* flags[] = {"--train_size", "--validation_size", "--test_size"};
  for (int s = 0; s < 3; ++s) {
    if (found[s] >= requested[s]) continue;
    const std::string what = "--dataset " + dataset + ": its " + names[s] + " split has " +
                             std::to_string(found[s]) + " pairs";
    if (found[s] == 0) throw std::invalid_argument(what);
    if (sizes_given != nullptr && sizes_given[s]) {
      throw std::invalid_argument(what + ", fewer than " + flags[s] + " " + std::to_string(requested[s]) +
                                  " asks for; pass " + flags[s] + " " + std::to_string(found[s]) + " or fewer");
    }
    std::cerr << what << " (fewer than the default " << flags[s] << " " << requested[s] << "): using all of them"
              << std::endl;
  }
  return corpus;
}

model::GPT2Config resolve_config(const ModelSource& source) {
  model::GPT2Config config;
  if (source.path.empty()) {
    config = model::GPT2Config::preset(source.preset);
  } else {
    const fs::path file = fs::path(source.path) / "config.json";
    if (!fs::exists(file)) {
      throw std::runtime_error("--model_path " + source.path + ": no config.json in that folder");
    }
    config = model::GPT2Config::from_json_file(file.string());
  }
  if (source.dropout) {
    if (*source.dropout < 0.0 || *source.dropout >= 1.0) {
      throw std::invalid_argument("--dropout " + std::to_string(*source.dropout) +
                                  " must be in [0, 1)");
    }
    config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = *source.dropout;
  }
  return config;
}

void check_positions(const model::GPT2Config& config, int64_t model_max_length) {
  if (config.n_positions >= model_max_length) return;
  throw std::invalid_argument("--model_max_length " + std::to_string(model_max_length) + " needs n_positions >= " +
                              std::to_string(model_max_length) + " but the model has n_positions " +
                              std::to_string(config.n_positions) + ": pass --model_max_length " +
                              std::to_string(config.n_positions) + " or less");
}

std::optional<data::Tokenizer> shipped_tokenizer(const ModelSource& source, const model::GPT2Config& config) {
  if (source.path.empty()) return std::nullopt;
  const fs::path shipped = fs::path(source.path) / "tokenizer.model";
  if (!fs::exists(shipped)) return std::nullopt;
  data::Tokenizer tokenizer = data::Tokenizer::load(shipped.string());
  if (config.vocab_size < tokenizer.vocab_size()) {
    throw std::invalid_argument("--model_path " + source.path + ": " + shipped.string() + " has " +
                                std::to_string(tokenizer.vocab_size()) + " pieces but config.json's vocab_size is " +
                                std::to_string(config.vocab_size) +
                                ": the tokenizer and the weights do not belong together (ids past the "
                                "vocabulary have no embedding row)");
  }
  return tokenizer;
}

data::Tokenizer prepare_tokenizer(const ModelSource& source, const model::GPT2Config& config,
                                  const std::vector<data::TranslationExample>& train,
                                  const std::string& save_path) {
  std::optional<data::Tokenizer> tokenizer = shipped_tokenizer(source, config);
  if (tokenizer) {
    const fs::path shipped = fs::path(source.path) / "tokenizer.model";
    std::cerr << "tokenizer: using " << shipped.string() << " shipped with the model\n";
    if (fs::absolute(shipped) != fs::absolute(save_path)) {
      fs::copy_file(shipped, save_path, fs::copy_options::overwrite_existing);
    }
  } else {
    try {
      tokenizer.emplace(data::Tokenizer::train(train, config.vocab_size, save_path));
    } catch (const data::VocabularyTooSmall& e) {
      throw std::invalid_argument(
          "the model's vocab_size is " + std::to_string(config.vocab_size) + " but the " +
          std::to_string(train.size()) + " training pairs need at least " + std::to_string(e.required) +
          " pieces (their distinct characters and the specials): use a model with a larger vocab_size (--model " +
          "gpt2-tiny has 1024, gpt2-mini 4096, gpt2 50257, or a --model_path whose config.json has one), or " +
          "fewer training pairs (--train_size)");
    }
  }
  if (config.vocab_size < tokenizer->vocab_size()) {
    throw std::runtime_error("the model's vocab_size " + std::to_string(config.vocab_size) +
                             " is smaller than the " + std::to_string(tokenizer->vocab_size()) +
                             " pieces of the tokenizer trained into " + save_path);
  }
  return std::move(*tokenizer);
}

void fit_vocabulary(model::GPT2Config& config, const ModelSource& source,
                    const data::Tokenizer& tokenizer) {
  if (!source.path.empty()) {
    std::cerr << "--fit_vocab: ignored for --model_path " << source.path
              << " (its vocab_size " << config.vocab_size << " holds trained rows)\n";
    return;
  }
  config.vocab_size = tokenizer.vocab_size();
}

model::GPT2LMHeadModel build_model(const ModelSource& source, const model::GPT2Config& config,
                                   uint64_t seed, std::shared_ptr<model::TensorParallelGroup> tp) {
  torch::manual_seed(seed);
  model::GPT2LMHeadModel model(config, std::move(tp));
  if (source.path.empty()) {
    model->reset_parameters();
  } else {
    model::load_pretrained(*model, source.path);
  }
  return model;
}

void make_directories(const std::string& path) {
  std::error_code error;
  fs::create_directories(path, error);
  if (error) throw std::runtime_error("cannot create folder " + path + ": " + error.message());
}

void check_writable_folder(const std::string& path, const std::string& flag) {
  std::error_code error;
  fs::create_directories(path, error);
  if (error) throw std::invalid_argument(flag + " " + path + ": cannot create the folder: " + error.message());
  const std::string probe = (fs::path(path) / (".harness-write-test-" + std::to_string(::getpid()))).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw std::invalid_argument(flag + " " + path + " is not writable: " + std::strerror(errno));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace harness::train
