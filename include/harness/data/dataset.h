// Loading a German-English corpus from local files: a folder of JSON Lines (train/validation/test
// .jsonl, what `datasets`' to_json writes) or the fairseq layout (train/valid/test .de + .en).
#pragma once

#include <cstddef>
#include <iosfwd>
#include <string>
#include <vector>

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

// Loads the first N pairs of each split. Errors are one line naming the file and the line
// (missing file, malformed or too deeply nested JSON, missing or non-string key, text that is
// not UTF-8, misaligned fairseq files, empty split). A UTF-8 byte-order mark and CRLF line ends
// are accepted in both layouts.
TranslationCorpus load_dataset(const std::string& dir, const SplitSizes& sizes = {});

// The two readers behind load_dataset, on streams (the fuzz targets feed them bytes): the first
// `limit` pairs of one split. `origin` (a file name) starts every error message.
std::vector<TranslationExample> read_jsonl_split(std::istream& in, const std::string& origin,
                                                 size_t limit);
std::vector<TranslationExample> read_fairseq_split(std::istream& de, const std::string& de_origin,
                                                   std::istream& en, const std::string& en_origin,
                                                   size_t limit);

// Writes train.jsonl, validation.jsonl, test.jsonl ({"translation": {"de", "en"}} per line) into
// `dir`, creating it; load_dataset(dir) reads them back unchanged.
void export_jsonl(const TranslationCorpus& corpus, const std::string& dir);

}  // namespace harness::data
