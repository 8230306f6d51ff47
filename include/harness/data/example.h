// One German-English sentence pair and the three splits of a translation corpus.
#pragma once

#include <string>
#include <vector>

namespace harness::data {

struct TranslationExample {
  std::string de;
  std::string en;
  bool operator==(const TranslationExample& o) const { return de == o.de && en == o.en; }
};

struct TranslationCorpus {
  std::vector<TranslationExample> train;
  std::vector<TranslationExample> validation;
  std::vector<TranslationExample> test;
};

}  // namespace harness::data
