// SentencePiece BPE tokenizer trained on the training pairs at every run (byte fallback on), with
// the three specials <eos_de>, <eos_en>, <pad> as single ids that are never split.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/data/example.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace harness::data {

// Tokenizer::train's error when the corpus has more distinct characters than the vocabulary
// cap allows: `required` pieces at least, `cap` allowed.
struct VocabularyTooSmall : std::invalid_argument {
  VocabularyTooSmall(int64_t required, int64_t cap);
  int64_t required, cap;
};

class Tokenizer {
 public:
  static constexpr const char* kEosDe = "<eos_de>";
  static constexpr const char* kEosEn = "<eos_en>";
  static constexpr const char* kPad = "<pad>";

  // Trains on the de and en sides of `examples`, writes `model_path` (tokenizer.model) and
  // returns the loaded tokenizer. The vocabulary is at most `max_vocab_size`; when the corpus
  // cannot fill it the size is smaller and a line on stderr says so.
  static Tokenizer train(const std::vector<TranslationExample>& examples, int64_t max_vocab_size,
                         const std::string& model_path);
  static Tokenizer load(const std::string& model_path);  // error names the file

  std::vector<int64_t> encode(const std::string& text) const;  // specials in text become their ids
  std::string decode(const std::vector<int64_t>& ids) const;   // specials are dropped

  int64_t vocab_size() const;
  int64_t eos_de_id() const { return eos_de_id_; }
  int64_t eos_en_id() const { return eos_en_id_; }
  int64_t pad_id() const { return pad_id_; }

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

 private:
  Tokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  int64_t eos_de_id_ = -1, eos_en_id_ = -1, pad_id_ = -1;
};

}  // namespace harness::data
