// The SentencePiece tokenizer: specials are single ids, round trip on the corpus, size cap.
#include "harness/data/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "harness/data/synthetic_corpus.h"
#include "../support/multi_process.h"

namespace harness::data {
namespace {

namespace fs = std::filesystem;

fs::path temp_path(const std::string& name) {
  return fs::path(test_workers::folder_removed_at_exit("harness-tokenizer-test")) / name;
}

const TranslationCorpus& corpus() {
  static const TranslationCorpus c = generate_corpus(7, SplitSizes{1000, 100, 50});
  return c;
}

// Trained once for the whole file (SentencePiece training takes a moment).
const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::train(corpus().train, 1000, temp_path("tokenizer.model").string());
  return t;
}

TEST(TokenizerTest, SpecialsAreSingleIdsEvenInsideText) {
  const Tokenizer& t = tokenizer();
  EXPECT_NE(t.eos_de_id(), t.eos_en_id());
  EXPECT_NE(t.eos_de_id(), t.pad_id());
  // Alone, a special is one id (after SentencePiece's dummy-prefix piece) and decodes to nothing.
  const std::vector<int64_t> alone = t.encode(Tokenizer::kEosDe);
  ASSERT_FALSE(alone.empty());
  EXPECT_EQ(alone.back(), t.eos_de_id());
  EXPECT_LE(alone.size(), 2u);
  EXPECT_EQ(t.decode(alone), "");
  const std::vector<int64_t> ids = t.encode("hallo<eos_de>welt<eos_en><pad>");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), t.eos_de_id()), 1);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), t.eos_en_id()), 1);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.back(), t.pad_id());
  const std::vector<int64_t> source = t.encode(corpus().train[0].de + Tokenizer::kEosDe);
  EXPECT_EQ(source.back(), t.eos_de_id());
  EXPECT_EQ(t.decode(source), corpus().train[0].de);  // specials dropped
}

TEST(TokenizerTest, NoSentencepieceBosOrEosAdded) {
  const Tokenizer& t = tokenizer();
  const std::vector<int64_t> plain = t.encode("der hund .");
  const std::vector<int64_t> with_eos = t.encode("der hund .<eos_de>");
  ASSERT_EQ(with_eos.size(), plain.size() + 1);
  EXPECT_TRUE(std::equal(plain.begin(), plain.end(), with_eos.begin()));
}

TEST(TokenizerTest, RoundTripsEveryCorpusSentence) {
  const Tokenizer& t = tokenizer();
  for (const auto* split : {&corpus().train, &corpus().validation, &corpus().test}) {
    for (const TranslationExample& example : *split) {
      ASSERT_EQ(t.decode(t.encode(example.de)), example.de);
      ASSERT_EQ(t.decode(t.encode(example.en)), example.en);
    }
  }
  // Unseen characters go through byte fallback and still come back.
  for (const std::string text : {"東京 über straße", "Mixed CASE & symbols {}~", "emoji 🙂 !"}) {
    EXPECT_EQ(t.decode(t.encode(text)), text);
  }
}

TEST(TokenizerTest, VocabularyIsCappedOrSmallerWhenTheCorpusCannotFillIt) {
  EXPECT_EQ(tokenizer().vocab_size(), 1000);  // this corpus fills 1000 pieces
  const std::vector<TranslationExample> few(corpus().train.begin(), corpus().train.begin() + 200);
  const Tokenizer capped = Tokenizer::train(few, 320, temp_path("capped.model").string());
  EXPECT_EQ(capped.vocab_size(), 320);

  testing::internal::CaptureStderr();
  const Tokenizer smaller = Tokenizer::train(few, 50000, temp_path("smaller.model").string());
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_LT(smaller.vocab_size(), 50000);
  EXPECT_GT(smaller.vocab_size(), 256 + 3);  // bytes + specials + pieces
  EXPECT_NE(log.find("cannot fill a vocabulary of 50000"), std::string::npos) << log;
  EXPECT_NE(log.find("using " + std::to_string(smaller.vocab_size())), std::string::npos) << log;
  for (const TranslationExample& example : few) ASSERT_EQ(smaller.decode(smaller.encode(example.en)), example.en);

  // Too small for the corpus's characters and the specials: a clear error with both numbers, not
  // a silent change and not SentencePiece's text about its own options.
  try {
    Tokenizer::train(few, 100, temp_path("tiny.model").string());
    FAIL() << "expected an error";
  } catch (const VocabularyTooSmall& e) {
    EXPECT_EQ(e.cap, 100);
    EXPECT_GT(e.required, 100);
    EXPECT_NE(std::string(e.what()).find("cap of 100"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("character_coverage"), std::string::npos) << e.what();
  }
}

TEST(TokenizerTest, TrainingIsDeterministicAndSavedModelLoads) {
  const Tokenizer& t = tokenizer();
  const Tokenizer again = Tokenizer::train(corpus().train, 1000, temp_path("again.model").string());
  std::ifstream a(temp_path("tokenizer.model"), std::ios::binary), b(temp_path("again.model"), std::ios::binary);
  const std::string bytes_a((std::istreambuf_iterator<char>(a)), {}), bytes_b((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(bytes_a.empty());
  EXPECT_EQ(bytes_a, bytes_b);
  const Tokenizer loaded = Tokenizer::load(temp_path("tokenizer.model").string());
  EXPECT_EQ(loaded.vocab_size(), t.vocab_size());
  EXPECT_EQ(loaded.pad_id(), t.pad_id());
  EXPECT_EQ(loaded.encode(corpus().test[0].de), t.encode(corpus().test[0].de));
}

TEST(TokenizerTest, ErrorsNameTheFileOrId) {
  const fs::path bad = temp_path("not_a_model.model");
  std::ofstream(bad) << "garbage";
  try {
    Tokenizer::load(bad.string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer::load(temp_path("missing.model").string()), std::runtime_error);
  EXPECT_THROW(tokenizer().decode({tokenizer().vocab_size()}), std::out_of_range);
}

}  // namespace
}  // namespace harness::data
