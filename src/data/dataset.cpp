// Loaders for the two on-disk layouts of a translation corpus, and the JSON Lines writer.
#include "harness/data/dataset.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace harness::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kJsonlFiles[] = {"train.jsonl", "validation.jsonl", "test.jsonl"};
constexpr const char* kFairseqPrefixes[] = {"train", "valid", "test"};

std::ifstream open_or_throw(const fs::path& path) {
  if (!fs::exists(path)) throw std::runtime_error("dataset file " + path.string() + " does not exist");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open dataset file " + path.string());
  return in;
}

void strip_carriage_return(std::string& line) {
  if (!line.empty() && line.back() == '\r') line.pop_back();
}

bool is_blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

std::string field_string(const nlohmann::json& object, const char* key, const fs::path& path,
                         size_t line_number) {
  const std::string where = path.string() + ":" + std::to_string(line_number);
  auto it = object.find(key);
  if (it == object.end()) {
    throw std::runtime_error(where + ": missing key \"" + key + "\" in " + object.dump());
  }
  if (!it->is_string()) {
    throw std::runtime_error(where + ": \"" + key + "\" must be a string, got " +
                             std::string(it->type_name()) + " " + it->dump());
  }
  return it->get<std::string>();
}

std::vector<TranslationExample> read_jsonl(const fs::path& path, size_t limit) {
  std::ifstream in = open_or_throw(path);
  std::vector<TranslationExample> examples;
  std::string line;
  size_t line_number = 0;
  while (examples.size() < limit && std::getline(in, line)) {
    ++line_number;
    if (is_blank(line)) continue;
    const std::string where = path.string() + ":" + std::to_string(line_number);
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw std::runtime_error(where + ": malformed JSON (" + e.what() + ")");
    }
    if (!record.is_object()) {
      throw std::runtime_error(where + ": expected a JSON object, got " + std::string(record.type_name()));
    }
    const nlohmann::json* pair = &record;
    if (auto it = record.find("translation"); it != record.end()) {
      if (!it->is_object()) {
        throw std::runtime_error(where + ": \"translation\" must be an object, got " +
                                 std::string(it->type_name()));
      }
      pair = &*it;
    }
    examples.push_back({field_string(*pair, "de", path, line_number),
                        field_string(*pair, "en", path, line_number)});
  }
  if (examples.empty() && limit > 0) {
    throw std::runtime_error("dataset file " + path.string() + " holds no examples (empty split)");
  }
  return examples;
}

std::vector<std::string> read_lines(const fs::path& path) {
  std::ifstream in = open_or_throw(path);
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    strip_carriage_return(line);
    lines.push_back(std::move(line));
  }
  return lines;
}

std::vector<TranslationExample> read_fairseq(const fs::path& dir, const std::string& prefix,
                                             size_t limit) {
  const fs::path de_path = dir / (prefix + ".de");
  const fs::path en_path = dir / (prefix + ".en");
  std::vector<std::string> de = read_lines(de_path);
  std::vector<std::string> en = read_lines(en_path);
  if (de.size() != en.size()) {
    throw std::runtime_error("misaligned fairseq files: " + de_path.string() + " has " +
                             std::to_string(de.size()) + " lines but " + en_path.string() + " has " +
                             std::to_string(en.size()));
  }
  std::vector<TranslationExample> examples;
  for (size_t i = 0; i < de.size() && examples.size() < limit; ++i) {
    if (is_blank(de[i]) != is_blank(en[i])) {
      const fs::path& blank = is_blank(de[i]) ? de_path : en_path;
      throw std::runtime_error(blank.string() + ":" + std::to_string(i + 1) +
                               ": empty line where the other language has a sentence");
    }
    if (is_blank(de[i])) continue;  // a blank line on both sides (e.g. a trailing one)
    examples.push_back({std::move(de[i]), std::move(en[i])});
  }
  if (examples.empty() && limit > 0) {
    throw std::runtime_error("dataset files " + de_path.string() + " and " + en_path.string() +
                             " hold no sentences (empty split)");
  }
  return examples;
}

}  // namespace

DatasetLayout detect_layout(const std::string& dir) {
  const fs::path root(dir);
  if (!fs::exists(root)) throw std::runtime_error("--dataset " + dir + ": no such file or directory");
  if (!fs::is_directory(root)) throw std::runtime_error("--dataset " + dir + ": not a directory");
  if (fs::exists(root / "train.jsonl")) return DatasetLayout::kJsonLines;
  if (fs::exists(root / "train.de") || fs::exists(root / "train.en")) return DatasetLayout::kFairseq;
  throw std::runtime_error(
      "--dataset " + dir +
      ": neither layout found; looked for JSON Lines (train.jsonl, validation.jsonl, test.jsonl) "
      "and fairseq (train.de/train.en, valid.de/valid.en, test.de/test.en)");
}

TranslationCorpus load_dataset(const std::string& dir, const SplitSizes& sizes) {
  const fs::path root(dir);
  const size_t limits[] = {sizes.train, sizes.validation, sizes.test};
  TranslationCorpus corpus;
  std::vector<TranslationExample>* splits[] = {&corpus.train, &corpus.validation, &corpus.test};
  switch (detect_layout(dir)) {
    case DatasetLayout::kJsonLines:
      for (int s = 0; s < 3; ++s) *splits[s] = read_jsonl(root / kJsonlFiles[s], limits[s]);
      break;
    case DatasetLayout::kFairseq:
      for (int s = 0; s < 3; ++s) *splits[s] = read_fairseq(root, kFairseqPrefixes[s], limits[s]);
      break;
  }
  return corpus;
}

void export_jsonl(const TranslationCorpus& corpus, const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw std::runtime_error("cannot create dataset folder " + dir + ": " + ec.message());
  const std::vector<TranslationExample>* splits[] = {&corpus.train, &corpus.validation, &corpus.test};
  for (int s = 0; s < 3; ++s) {
    const fs::path path = root / kJsonlFiles[s];
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + path.string());
    for (const TranslationExample& example : *splits[s]) {
      nlohmann::json record = {{"translation", {{"de", example.de}, {"en", example.en}}}};
      out << record.dump() << '\n';
    }
    if (!out) throw std::runtime_error("error while writing " + path.string());
  }
}

}  // namespace harness::data
