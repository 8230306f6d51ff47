// The printed figures and the per-epoch files of SPEC §7: number formatting, mean/std, JSON.
#pragma once

#include <string>
#include <vector>

#include "harness/data/example.h"

namespace harness::train {

// A plain decimal (no exponent) that reads back as the same double: 0.00001, 12.5, 3.
std::string format_number(double value);

struct MeanStd {
  double mean = 0.0;
  double std = 0.0;  // population standard deviation, as numpy's np.std
};
MeanStd mean_std(const std::vector<double>& values);

struct EpochResults {
  double validation_loss = 0.0;
  double bleu = 0.0;
  double training_time = 0.0;
  double tokens_per_sec = 0.0;
};

// {"validation_loss", "bleu", "training_time", "tokens_per_sec"}
void write_results_json(const std::string& path, const EpochResults& results);
// [{"example": {"de", "en"}, "gen": "..."}, ...]
void write_generations_json(const std::string& path,
                            const std::vector<data::TranslationExample>& examples,
                            const std::vector<std::string>& generations);

}  // namespace harness::train
