// sacrebleu 2.x corpus BLEU re-implemented: Tokenizer13a + TokenizerRegexp on UTF-8 bytes (its
// patterns are ASCII, so byte-wise matching gives Python's code-point result), n-gram clipping
// against one reference, BLEU.compute_bleu with smooth_method 'exp'.
#include "harness/train/bleu.h"

#include <cmath>
#include <map>
#include <stdexcept>

namespace harness::train {
namespace {

void replace_all(std::string& text, const std::string& from, const std::string& to) {
  size_t pos = 0;
  while ((pos = text.find(from, pos)) != std::string::npos) {
    text.replace(pos, from.size(), to);
    pos += to.size();
  }
}

bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

// [\{-\~\[-\` -\&\(-\+\:-\@\/]
bool is_13a_symbol(unsigned char c) {
  return (c >= '{' && c <= '~') || (c >= '[' && c <= '`') || (c >= ' ' && c <= '&') ||
         (c >= '(' && c <= '+') || (c >= ':' && c <= '@') || c == '/';
}

bool is_period_or_comma(unsigned char c) { return c == '.' || c == ','; }

// Length of the Unicode whitespace character (as Python's str.split sees it) at `pos`, or 0.
size_t whitespace_length(const std::string& s, size_t pos) {
  const auto c = static_cast<unsigned char>(s[pos]);
  if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return 1;
  auto byte = [&](size_t i) -> unsigned { return i < s.size() ? static_cast<unsigned char>(s[i]) : 0u; };
  if (c == 0xc2 && (byte(pos + 1) == 0x85 || byte(pos + 1) == 0xa0)) return 2;  // U+0085, U+00A0
  if (c == 0xe1 && byte(pos + 1) == 0x9a && byte(pos + 2) == 0x80) return 3;    // U+1680
  if (c == 0xe2 && byte(pos + 1) == 0x80) {
    const unsigned third = byte(pos + 2);
    // U+2000..U+200A, U+2028, U+2029, U+202F
    if ((third >= 0x80 && third <= 0x8a) || third == 0xa8 || third == 0xa9 || third == 0xaf) return 3;
  }
  if (c == 0xe2 && byte(pos + 1) == 0x81 && byte(pos + 2) == 0x9f) return 3;  // U+205F
  if (c == 0xe3 && byte(pos + 1) == 0x80 && byte(pos + 2) == 0x80) return 3;  // U+3000
  return 0;
}

// Python's str.split(): runs of whitespace separate, none at the ends.
std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> words;
  std::string current;
  for (size_t pos = 0; pos < text.size();) {
    const size_t ws = whitespace_length(text, pos);
    if (ws > 0) {
      if (!current.empty()) words.push_back(std::move(current));
      current.clear();
      pos += ws;
    } else {
      current += text[pos++];
    }
  }
  if (!current.empty()) words.push_back(std::move(current));
  return words;
}

// re.sub for a pattern of two single-character classes: scans left to right, non-overlapping.
template <typename First, typename Second, typename Emit>
std::string substitute_pairs(const std::string& text, First first, Second second, Emit emit) {
  std::string out;
  out.reserve(text.size() + 16);
  size_t i = 0;
  while (i < text.size()) {
    const auto a = static_cast<unsigned char>(text[i]);
    if (i + 1 < text.size() && first(a) && second(static_cast<unsigned char>(text[i + 1]))) {
      emit(out, text[i], text[i + 1]);
      i += 2;
    } else {
      out += text[i++];
    }
  }
  return out;
}

std::string strip_right(const std::string& text) {
  size_t end = text.size();
  while (end > 0) {
    // Step back over one UTF-8 character and test whether it is whitespace.
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xc0) == 0x80) --start;
    if (whitespace_length(text, start) != end - start) break;
    end = start;
  }
  return text.substr(0, end);
}

using NgramCounts = std::map<std::vector<std::string>, int64_t>;

NgramCounts count_ngrams(const std::vector<std::string>& tokens) {
  NgramCounts counts;
  for (int n = 1; n <= kBleuMaxOrder; ++n) {
    for (size_t i = 0; i + n <= tokens.size(); ++i) {
      ++counts[std::vector<std::string>(tokens.begin() + i, tokens.begin() + i + n)];
    }
  }
  return counts;
}

}  // namespace

std::string tokenize_13a(const std::string& input) {
  std::string line = input;
  replace_all(line, "<skipped>", "");
  replace_all(line, "-\n", "");
  replace_all(line, "\n", " ");
  if (line.find('&') != std::string::npos) {
    replace_all(line, "&quot;", "\"");
    replace_all(line, "&amp;", "&");
    replace_all(line, "&lt;", "<");
    replace_all(line, "&gt;", ">");
  }
  line = " " + line + " ";

  std::string spaced;
  spaced.reserve(line.size() * 2);
  for (char c : line) {
    if (is_13a_symbol(static_cast<unsigned char>(c))) {
      spaced += ' ';
      spaced += c;
      spaced += ' ';
    } else {
      spaced += c;
    }
  }
  // period and comma unless preceded by a digit: ([^0-9])([\.,]) -> \1 \2 (space after)
  spaced = substitute_pairs(
      spaced, [](unsigned char c) { return !is_digit(c); }, is_period_or_comma,
      [](std::string& out, char a, char b) { out += a; out += ' '; out += b; out += ' '; });
  // period and comma unless followed by a digit: ([\.,])([^0-9]) -> ' \1 \2'
  spaced = substitute_pairs(
      spaced, is_period_or_comma, [](unsigned char c) { return !is_digit(c); },
      [](std::string& out, char a, char b) { out += ' '; out += a; out += ' '; out += b; });
  // dash preceded by a digit: ([0-9])(-) -> \1 \2 (space after)
  spaced = substitute_pairs(
      spaced, is_digit, [](unsigned char c) { return c == '-'; },
      [](std::string& out, char a, char b) { out += a; out += ' '; out += b; out += ' '; });

  const std::vector<std::string> words = split_words(spaced);
  std::string joined;
  for (size_t i = 0; i < words.size(); ++i) {
    if (i) joined += ' ';
    joined += words[i];
  }
  return joined;
}

BleuStats bleu_stats(const std::vector<std::string>& hypotheses,
                     const std::vector<std::string>& references) {
  if (hypotheses.size() != references.size()) {
    throw std::invalid_argument("corpus_bleu: " + std::to_string(hypotheses.size()) +
                                " hypotheses but " + std::to_string(references.size()) +
                                " references");
  }
  BleuStats stats;
  for (size_t s = 0; s < hypotheses.size(); ++s) {
    const std::vector<std::string> hyp = split_words(tokenize_13a(strip_right(hypotheses[s])));
    const std::vector<std::string> ref = split_words(tokenize_13a(strip_right(references[s])));
    stats.sys_len += static_cast<int64_t>(hyp.size());
    stats.ref_len += static_cast<int64_t>(ref.size());
    const NgramCounts ref_counts = count_ngrams(ref);
    for (const auto& [ngram, count] : count_ngrams(hyp)) {
      const size_t n = ngram.size() - 1;
      stats.total[n] += count;
      auto it = ref_counts.find(ngram);
      if (it != ref_counts.end()) stats.correct[n] += std::min(count, it->second);
    }
  }
  return stats;
}

double bleu_from_stats(const BleuStats& stats) {
  double brevity_penalty = 1.0;
  if (stats.sys_len < stats.ref_len) {
    brevity_penalty = stats.sys_len > 0
                          ? std::exp(1.0 - static_cast<double>(stats.ref_len) / static_cast<double>(stats.sys_len))
                          : 0.0;
  }
  bool any_correct = false;
  for (int64_t c : stats.correct) any_correct = any_correct || c != 0;
  if (!any_correct) return 0.0;

  double precisions[kBleuMaxOrder] = {0.0, 0.0, 0.0, 0.0};
  double smooth_mteval = 1.0;
  for (int n = 0; n < kBleuMaxOrder; ++n) {
    if (stats.total[n] == 0) break;
    if (stats.correct[n] == 0) {
      smooth_mteval *= 2;
      precisions[n] = 100.0 / (smooth_mteval * static_cast<double>(stats.total[n]));
    } else {
      precisions[n] = 100.0 * static_cast<double>(stats.correct[n]) / static_cast<double>(stats.total[n]);
    }
  }
  // sacrebleu's my_log floors log(0) at -9999999999.
  double log_sum = 0.0;
  for (double p : precisions) log_sum += p == 0.0 ? -9999999999.0 : std::log(p);
  return brevity_penalty * std::exp(log_sum / kBleuMaxOrder);
}

double corpus_bleu(const std::vector<std::string>& hypotheses,
                   const std::vector<std::string>& references) {
  return bleu_from_stats(bleu_stats(hypotheses, references));
}

}  // namespace harness::train
