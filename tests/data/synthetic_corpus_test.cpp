// The embedded corpus: determinism, disjoint splits, sentence shape, and that it is translation.
#include "harness/data/synthetic_corpus.h"
#include "harness/train/checkpoint/checkpoint_store.h"

#include <gtest/gtest.h>

#include <set>
#include <sstream>
#include <unordered_set>

namespace harness::data {
namespace {

std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

const TranslationCorpus& default_corpus() {
  static const TranslationCorpus corpus = generate_corpus(1234);
  return corpus;
}

TEST(SyntheticCorpusTest, HasTheOriginalsSplitSizes) {
  const TranslationCorpus& corpus = default_corpus();
  EXPECT_EQ(corpus.train.size(), 5000u);
  EXPECT_EQ(corpus.validation.size(), 1000u);
  EXPECT_EQ(corpus.test.size(), 100u);
  const TranslationCorpus small = generate_corpus(1234, SplitSizes{10, 3, 2});
  EXPECT_EQ(small.train.size(), 10u);
  EXPECT_EQ(small.validation.size(), 3u);
  EXPECT_EQ(small.test.size(), 2u);
}

TEST(SyntheticCorpusTest, IsDeterministicInTheSeed) {
  const TranslationCorpus again = generate_corpus(1234);
  EXPECT_EQ(again.train, default_corpus().train);
  EXPECT_EQ(again.validation, default_corpus().validation);
  EXPECT_EQ(again.test, default_corpus().test);
  const TranslationCorpus other = generate_corpus(99, SplitSizes{50, 10, 10});
  const TranslationCorpus small = generate_corpus(1234, SplitSizes{50, 10, 10});
  EXPECT_NE(other.train, small.train);
  // A smaller corpus starts with the same pairs.
  EXPECT_EQ(generate_corpus(1234, SplitSizes{3, 1, 1}).train,
            (std::vector<TranslationExample>(default_corpus().train.begin(),
                                             default_corpus().train.begin() + 3)));
}

TEST(SyntheticCorpusTest, IsPinnedToLiteralSentencesAndAChecksum) {
  // The corpus must not drift across standard libraries, compilers or edits of the sampler:
  // results, figures and checkpoints refer to it.
  const TranslationCorpus& corpus = default_corpus();
  EXPECT_EQ(corpus.train[0], (TranslationExample{"ein kind besucht den schönen lehrer im wald .",
                                                 "a child visits the beautiful teacher in the forest ."}));
  EXPECT_EQ(corpus.train[1], (TranslationExample{"der mann ruft die große frau im wald an .",
                                                 "the man calls the big woman in the forest ."}));
  EXPECT_EQ(corpus.train[2], (TranslationExample{"ein schöner hund muss ein fahrrad in der schule sehen .",
                                                 "a beautiful dog must see a bike at school ."}));
  std::string all;
  for (const auto* split : {&corpus.train, &corpus.validation, &corpus.test}) {
    for (const TranslationExample& e : *split) all += e.de + "\t" + e.en + "\n";
  }
  EXPECT_EQ(train::sha256_hex(all.data(), all.size()),
            "6b9cd82e24d0d875917bed39e6d678517ced7c5373c6e6b87778fedf8c9ddb86");
}

TEST(SyntheticCorpusTest, NoSentenceRepeatsWithinOrAcrossSplits) {
  std::unordered_set<std::string> de, en;
  size_t total = 0;
  for (const auto* split : {&default_corpus().train, &default_corpus().validation, &default_corpus().test}) {
    for (const TranslationExample& example : *split) {
      de.insert(example.de);
      en.insert(example.en);
      ++total;
    }
  }
  EXPECT_EQ(de.size(), total);
  EXPECT_EQ(en.size(), total);
}

TEST(SyntheticCorpusTest, SentencesAreShortLowerCaseAndEndWithSpacedPeriod) {
  std::set<std::string> vocabulary_de, vocabulary_en;
  for (const TranslationExample& example : default_corpus().train) {
    const auto de = words(example.de);
    ASSERT_GE(de.size(), 5u) << example.de;   // 4 words + "."
    ASSERT_LE(de.size(), 13u) << example.de;  // 12 words + "."
    EXPECT_EQ(de.back(), ".");
    EXPECT_EQ(words(example.en).back(), ".");
    for (char c : example.de + example.en) EXPECT_FALSE(c >= 'A' && c <= 'Z') << example.de;
    EXPECT_EQ(example.de.find("  "), std::string::npos);
    vocabulary_de.insert(de.begin(), de.end());
    const auto en = words(example.en);
    vocabulary_en.insert(en.begin(), en.end());
  }
  // A modest vocabulary that a small model learns in a few CPU-minutes.
  EXPECT_GE(vocabulary_de.size(), 80u);
  EXPECT_LE(vocabulary_de.size(), 220u);
  EXPECT_LE(vocabulary_en.size(), 200u);
}

TEST(SyntheticCorpusTest, IsATranslationNotACopy) {
  size_t differ_in_words = 0, verb_final = 0;
  const auto& train = default_corpus().train;
  for (const TranslationExample& example : train) {
    const auto de = words(example.de), en = words(example.en);
    std::multiset<std::string> de_set(de.begin(), de.end()), en_set(en.begin(), en.end());
    if (de_set != en_set) ++differ_in_words;
    const std::string& last = de[de.size() - 2];
    if (last.rfind("ge", 0) == 0 || (last.size() > 2 && last.compare(last.size() - 2, 2, "en") == 0)) ++verb_final;
  }
  EXPECT_EQ(differ_in_words, train.size());
  EXPECT_GT(verb_final, train.size() / 5);  // modal and perfect sentences end in the verb
}

TEST(SyntheticCorpusTest, TranslatesTheGrammarAsExpected) {
  // Find characteristic constructions in the sample and check their translations.
  bool modal = false, perfect = false, separable = false, fronted_time = false, number = false;
  for (const TranslationExample& example : default_corpus().train) {
    const std::string& de = example.de;
    const std::string& en = example.en;
    if (de.rfind("der hund will ", 0) == 0) {
      modal = true;
      EXPECT_EQ(en.rfind("the dog wants to ", 0), 0u) << de << " -> " << en;
    }
    if (de.rfind("die frau hat ", 0) == 0 && de.find(" gekauft .") != std::string::npos) {
      perfect = true;
      EXPECT_EQ(en.rfind("the woman bought ", 0), 0u) << de << " -> " << en;
    }
    if (de.find(" ruft ") != std::string::npos && de.find(" an .") != std::string::npos) {
      separable = true;
      EXPECT_NE(en.find(" calls "), std::string::npos) << de << " -> " << en;
    }
    if (de.rfind("am montag ", 0) == 0) {
      fronted_time = true;
      EXPECT_EQ(en.rfind("on monday ", 0), 0u) << de << " -> " << en;
    }
    if (de.rfind("drei ", 0) == 0) {
      number = true;
      EXPECT_EQ(en.rfind("three ", 0), 0u) << de << " -> " << en;
    }
  }
  EXPECT_TRUE(modal && perfect && separable && fronted_time && number);
}

}  // namespace
}  // namespace harness::data
