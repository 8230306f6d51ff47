// Loading a German-English corpus from local files: a folder of JSON Lines (train/validation/test
// .jsonl, what `datasets`' to_json writes) or the fairseq layout (train/valid/test .de + .en).
#pragma once

#include <cstddef>
#include <string>

#include "harness/data/example.h"

namespace harness::data {

// How many pairs of each split are kept (the first N); the original's slice sizes by default.
struct SplitSizes {
  size_t train = 5000;
  size_t validation = 1000;
  size_t test = 100;
};

enum class DatasetLayout { kJsonLines, kFairseq };

// Which layout `dir` holds; throws naming what was looked for when it is neither.
DatasetLayout detect_layout(const std::string& dir);

// Loads the first N pairs of each split. Errors name the file and the line (missing file,
// malformed JSON, missing or non-string key, misaligned fairseq files, empty split).
TranslationCorpus load_dataset(const std::string& dir, const SplitSizes& sizes = {});

// Writes train.jsonl, validation.jsonl, test.jsonl ({"translation": {"de", "en"}} per line) into
// `dir`, creating it; load_dataset(dir) reads them back unchanged.
void export_jsonl(const TranslationCorpus& corpus, const std::string& dir);

}  // namespace harness::data
