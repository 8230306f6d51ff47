// corpus_bleu against scores sacrebleu computed (tests/fixtures/bleu, scripts/make_bleu_fixture.py).
#include "harness/train/bleu.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace harness::train {
namespace {

nlohmann::json load_fixture() {
  const std::string path = std::string(HARNESS_FIXTURES_DIR) + "/bleu/sacrebleu_cases.json";
  std::ifstream in(path);
  EXPECT_TRUE(in) << "missing fixture " << path;
  return nlohmann::json::parse(in);
}

TEST(BleuTest, MatchesSacrebleuOnEveryFixtureCorpus) {
  const nlohmann::json fixture = load_fixture();
  ASSERT_GE(fixture["corpora"].size(), 10u);
  for (const auto& corpus : fixture["corpora"]) {
    SCOPED_TRACE(corpus["name"].get<std::string>());
    const auto hypotheses = corpus["hypotheses"].get<std::vector<std::string>>();
    const auto references = corpus["references"].get<std::vector<std::string>>();
    const BleuStats stats = bleu_stats(hypotheses, references);
    EXPECT_EQ(stats.sys_len, corpus["sys_len"].get<int64_t>());
    EXPECT_EQ(stats.ref_len, corpus["ref_len"].get<int64_t>());
    for (int n = 0; n < kBleuMaxOrder; ++n) {
      EXPECT_EQ(stats.correct[n], corpus["counts"][n].get<int64_t>()) << "order " << n + 1;
      EXPECT_EQ(stats.total[n], corpus["totals"][n].get<int64_t>()) << "order " << n + 1;
    }
    EXPECT_NEAR(corpus_bleu(hypotheses, references), corpus["score"].get<double>(), 1e-9);
  }
}

TEST(BleuTest, Tokenize13aMatchesSacrebleu) {
  const nlohmann::json fixture = load_fixture();
  ASSERT_FALSE(fixture["tokenize_13a"].empty());
  for (const auto& line : fixture["tokenize_13a"]) {
    EXPECT_EQ(tokenize_13a(line["input"].get<std::string>()), line["output"].get<std::string>())
        << "input: " << line["input"].dump();
  }
}

TEST(BleuTest, PerfectAndDisjointCorpora) {
  EXPECT_NEAR(corpus_bleu({"a b c d e"}, {"a b c d e"}), 100.0, 1e-9);
  EXPECT_EQ(corpus_bleu({"v w x y z"}, {"a b c d e"}), 0.0);
}

TEST(BleuTest, HandComputedSmoothingAndBrevityPenalty) {
  // hyp "a b c d" vs ref "a b c e f": precisions 3/4, 2/3, 1/2, and 4-grams 0/1 -> exp smoothing
  // gives 100 / (2 * 1); brevity penalty exp(1 - 5/4).
  const double expected = std::exp(1.0 - 5.0 / 4.0) *
                          std::exp((std::log(75.0) + std::log(200.0 / 3.0) + std::log(50.0) +
                                    std::log(50.0)) / 4.0);
  EXPECT_NEAR(corpus_bleu({"a b c d"}, {"a b c e f"}), expected, 1e-9);
}

TEST(BleuTest, MismatchedLengthsNameBothCounts) {
  try {
    corpus_bleu({"a", "b"}, {"a"});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2 hypotheses but 1 references"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace harness::train
