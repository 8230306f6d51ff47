// Corpus BLEU exactly as sacrebleu 2.x computes it by default: 13a tokenisation, n-grams up to 4,
// one reference per hypothesis, exponential smoothing, brevity penalty, on a 0-100 scale.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace harness::train {

constexpr int kBleuMaxOrder = 4;

// Sufficient statistics, summed over the corpus.
struct BleuStats {
  int64_t sys_len = 0;  // hypothesis tokens
  int64_t ref_len = 0;  // reference tokens
  std::array<int64_t, kBleuMaxOrder> correct{};  // clipped n-gram matches, n = 1..4
  std::array<int64_t, kBleuMaxOrder> total{};    // hypothesis n-grams, n = 1..4
};

// sacrebleu's "13a" tokenizer (mteval-v13a), on UTF-8 text.
std::string tokenize_13a(const std::string& line);

// Statistics of a corpus; throws when the two lists differ in length.
BleuStats bleu_stats(const std::vector<std::string>& hypotheses,
                     const std::vector<std::string>& references);

// The score from statistics (smooth_method 'exp').
double bleu_from_stats(const BleuStats& stats);

// = sacrebleu.corpus_bleu(hypotheses, [references]).score
double corpus_bleu(const std::vector<std::string>& hypotheses,
                   const std::vector<std::string>& references);

}  // namespace harness::train
