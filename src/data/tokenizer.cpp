// SentencePiece BPE trained in memory on both sides of the training pairs; the model file is the
// serialized proto, so `spm_encode --model tokenizer.model` and Python's sentencepiece read it.
#include "harness/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace harness::data {
namespace {

// Feeds de and en sentences of every example, in order, to the trainer.
class ExampleSentences : public sentencepiece::SentenceIterator {
 public:
  explicit ExampleSentences(const std::vector<TranslationExample>& examples)
      : examples_(examples) {}
  bool done() const override { return index_ >= 2 * examples_.size(); }
  void Next() override { ++index_; }
  const std::string& value() const override {
    const TranslationExample& example = examples_[index_ / 2];
    return index_ % 2 == 0 ? example.de : example.en;
  }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<TranslationExample>& examples_;
  size_t index_ = 0;
};

std::unordered_map<std::string, std::string> trainer_arguments(int64_t vocab_size) {
  return {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"user_defined_symbols", std::string(Tokenizer::kEosDe) + "," + Tokenizer::kEosEn + "," +
                                   Tokenizer::kPad},
      {"unk_id", "0"},
      {"bos_id", "-1"},
      {"eos_id", "-1"},
      {"pad_id", "-1"},
      // Identity normalisation and kept whitespace make decode(encode(s)) == s.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"split_digits", "false"},
      // Deterministic: every sentence, in order, no sampling.
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
      {"num_threads", "1"},
      {"max_sentence_length", "1000000"},
      {"minloglevel", "2"},
  };
}

// SentencePiece says "Vocabulary size too high (N). Please set it to a value <= M." when the
// corpus has fewer pieces than asked for; returns M, or -1 when the message is another one.
int64_t accepted_vocab_size(const std::string& message) {
  static const std::regex kTooHigh(R"(<= *([0-9]+))");
  std::smatch match;
  if (message.find("too high") != std::string::npos && std::regex_search(message, match, kTooHigh)) {
    return std::stoll(match[1].str());
  }
  return -1;
}

// SentencePiece says "Vocabulary size is smaller than required_chars. 64 vs 291." when the
// corpus has more distinct characters than the vocabulary may hold; returns 291, or -1.
int64_t required_vocab_size(const std::string& message) {
  static const std::regex kRequired(R"(required_chars\. *[0-9]+ *vs *([0-9]+))");
  std::smatch match;
  if (std::regex_search(message, match, kRequired)) return std::stoll(match[1].str());
  return -1;
}

}  // namespace

VocabularyTooSmall::VocabularyTooSmall(int64_t required, int64_t cap)
    : std::invalid_argument("the training pairs need a vocabulary of at least " + std::to_string(required) +
                            " pieces (their distinct characters and the special pieces), more than the cap of " +
                            std::to_string(cap)),
      required(required),
      cap(cap) {}

Tokenizer::Tokenizer() : processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::train(const std::vector<TranslationExample>& examples, int64_t max_vocab_size,
                           const std::string& model_path) {
  if (examples.empty()) throw std::invalid_argument("Tokenizer::train: no training examples");
  if (max_vocab_size <= 0) {
    throw std::invalid_argument("Tokenizer::train: max_vocab_size must be positive, got " +
                                std::to_string(max_vocab_size));
  }
  std::string serialized;
  int64_t vocab_size = max_vocab_size;
  for (int attempt = 0;; ++attempt) {
    ExampleSentences sentences(examples);
    serialized.clear();
    const auto status = sentencepiece::SentencePieceTrainer::Train(
        trainer_arguments(vocab_size), &sentences, &serialized);
    if (status.ok()) break;
    const int64_t accepted = accepted_vocab_size(status.ToString());
    if (attempt == 0 && accepted > 0 && accepted < vocab_size) {
      std::cerr << "[tokenizer] the training corpus cannot fill a vocabulary of " << vocab_size
                << " pieces; using " << accepted << " instead" << std::endl;
      vocab_size = accepted;
      continue;
    }
    const int64_t required = required_vocab_size(status.ToString());
    if (required > 0) throw VocabularyTooSmall(required, vocab_size);
    throw std::runtime_error("Tokenizer::train: SentencePiece failed with vocab_size " +
                             std::to_string(vocab_size) + " (max_vocab_size " +
                             std::to_string(max_vocab_size) + "): " + status.ToString());
  }

  const std::filesystem::path path(model_path);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(serialized.data(), static_cast<std::streamsize>(serialized.size()));
    if (!out) throw std::runtime_error("Tokenizer::train: cannot write " + model_path);
  }
  return load(model_path);
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  std::ifstream in(model_path, std::ios::binary);
  if (!in) throw std::runtime_error("tokenizer model " + model_path + " cannot be opened");
  std::stringstream buffer;
  buffer << in.rdbuf();
  Tokenizer tokenizer;
  const auto status = tokenizer.processor_->LoadFromSerializedProto(buffer.str());
  if (!status.ok()) {
    throw std::runtime_error("tokenizer model " + model_path +
                             " is not a SentencePiece model: " + status.ToString());
  }
  auto special_id = [&](const char* piece) -> int64_t {
    const int id = tokenizer.processor_->PieceToId(piece);
    if (id < 0 || tokenizer.processor_->IsUnknown(id) || tokenizer.processor_->IdToPiece(id) != piece) {
      throw std::runtime_error("tokenizer model " + model_path + " has no special token " + piece);
    }
    return id;
  };
  tokenizer.eos_de_id_ = special_id(kEosDe);
  tokenizer.eos_en_id_ = special_id(kEosEn);
  tokenizer.pad_id_ = special_id(kPad);
  return tokenizer;
}

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  if (!status.ok()) throw std::runtime_error("Tokenizer::encode: " + status.ToString());
  return std::vector<int64_t>(ids.begin(), ids.end());
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  const int64_t size = vocab_size();
  std::vector<int> kept;
  kept.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= size) {
      throw std::out_of_range("Tokenizer::decode: id " + std::to_string(id) + " at position " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(size) + ")");
    }
    if (id == eos_de_id_ || id == eos_en_id_ || id == pad_id_) continue;
    kept.push_back(static_cast<int>(id));
  }
  std::string text;
  const auto status = processor_->Decode(kept, &text);
  if (!status.ok()) throw std::runtime_error("Tokenizer::decode: " + status.ToString());
  return text;
}

int64_t Tokenizer::vocab_size() const { return processor_->GetPieceSize(); }

}  // namespace harness::data
