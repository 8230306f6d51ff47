// Loaders for the two on-disk layouts of a translation corpus, and the JSON Lines writer.
#include "harness/data/dataset.h"

#include "../model/json_depth.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <istream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace harness::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kJsonlFiles[] = {"train.jsonl", "validation.jsonl", "test.jsonl"};
constexpr const char* kFairseqPrefixes[] = {"train", "valid", "test"};
// A record nests two levels ({"translation": {"de", "en"}}); other columns may nest a little.
// nlohmann::json copies and destroys recursively, so deeper lines are refused before parsing.
constexpr int kMaxJsonlDepth = 64;
constexpr const char kByteOrderMark[] = "\xEF\xBB\xBF";

std::ifstream open_or_throw(const fs::path& path) {
  if (!fs::exists(path)) throw std::runtime_error("dataset file " + path.string() + " does not exist");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open dataset file " + path.string());
  return in;
}

// Editors on Windows save UTF-8 with a byte-order mark and CRLF line ends; neither is text.
void strip_byte_order_mark(std::string& first_line) {
  if (first_line.compare(0, 3, kByteOrderMark) == 0) first_line.erase(0, 3);
}

// Every trailing CR goes: a file converted to CRLF twice ends its lines in "\r\r\n".
void strip_carriage_returns(std::string& line) {
  while (!line.empty() && line.back() == '\r') line.pop_back();
}

bool is_blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

// Index of the first byte that does not begin a well-formed UTF-8 sequence (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF), or npos. JSON, and so export_jsonl, needs UTF-8.
size_t invalid_utf8_at(const std::string& text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t continuation = 0;
    unsigned char low = 0x80, high = 0xBF;  // the allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      continuation = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      continuation = 2;
      if (c == 0xE0) low = 0xA0;   // overlong
      if (c == 0xED) high = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      continuation = 3;
      if (c == 0xF0) low = 0x90;   // overlong
      if (c == 0xF4) high = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + continuation >= text.size()) return i;
    for (size_t k = 1; k <= continuation; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if (b < (k == 1 ? low : 0x80) || b > (k == 1 ? high : 0xBF)) return i;
    }
    i += continuation + 1;
  }
  return std::string::npos;
}

// `text` for an error message: quoted, control characters escaped, cut after kShownBytes bytes
// (at a character boundary) so that the message stays one short line.
std::string shown(const std::string& text) {
  constexpr size_t kShownBytes = 60;
  size_t end = std::min(text.size(), kShownBytes);
  while (end > 0 && end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  std::string out = "\"";
  for (size_t i = 0; i < end; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
  if (end < text.size()) out += "...";
  return out;
}

// What a JSON value is, for an error message, without serialising it: dump() recurses once per
// nesting level and can be as long as the line.
std::string describe(const json& value) {
  switch (value.type()) {
    case json::value_t::object: return "an object with " + std::to_string(value.size()) + " key(s)";
    case json::value_t::array: return "an array of " + std::to_string(value.size()) + " element(s)";
    case json::value_t::string: return "the string " + shown(value.get_ref<const std::string&>());
    case json::value_t::boolean: return value.get<bool>() ? "true" : "false";
    case json::value_t::null: return "null";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "the number " + value.dump();  // a scalar: no recursion
    default: return value.type_name();
  }
}

std::string field_string(const json& object, const char* key, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end()) {
    std::string keys;
    size_t listed = 0;
    for (auto k = object.begin(); k != object.end() && listed < 4; ++k, ++listed) {
      keys += (listed ? ", " : "") + shown(k.key());
    }
    if (object.size() > listed) keys += ", ...";
    throw std::runtime_error(where + ": missing key \"" + key + "\" (" +
                             (object.empty() ? "the object is empty" : "the object has keys " + keys) +
                             ")");
  }
  if (!it->is_string()) {
    throw std::runtime_error(where + ": \"" + key + "\" must be a string, got " + describe(*it));
  }
  return it->get<std::string>();
}

std::vector<std::string> read_lines(std::istream& in, const std::string& origin) {
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    if (lines.empty()) strip_byte_order_mark(line);
    strip_carriage_returns(line);
    if (const size_t at = invalid_utf8_at(line); at != std::string::npos) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(line[at]));
      throw std::runtime_error(origin + ":" + std::to_string(lines.size() + 1) +
                               ": not UTF-8 text (invalid byte " + byte + " at column " +
                               std::to_string(at + 1) + ")");
    }
    lines.push_back(std::move(line));
  }
  if (in.bad()) throw std::runtime_error(origin + ": read error after line " + std::to_string(lines.size()));
  return lines;
}

std::vector<TranslationExample> read_jsonl(const fs::path& path, size_t limit) {
  std::ifstream in = open_or_throw(path);
  return read_jsonl_split(in, path.string(), limit);
}

std::vector<TranslationExample> read_fairseq(const fs::path& dir, const std::string& prefix,
                                             size_t limit) {
  const fs::path de_path = dir / (prefix + ".de");
  const fs::path en_path = dir / (prefix + ".en");
  std::ifstream de = open_or_throw(de_path);
  std::ifstream en = open_or_throw(en_path);
  return read_fairseq_split(de, de_path.string(), en, en_path.string(), limit);
}

}  // namespace

std::vector<TranslationExample> read_jsonl_split(std::istream& in, const std::string& origin,
                                                 size_t limit) {
  std::vector<TranslationExample> examples;
  std::string line;
  size_t line_number = 0;
  while (examples.size() < limit && std::getline(in, line)) {
    ++line_number;
    if (line_number == 1) strip_byte_order_mark(line);
    strip_carriage_returns(line);
    if (is_blank(line)) continue;
    const std::string where = origin + ":" + std::to_string(line_number);
    model::detail::check_json_nesting(line.data(), line.size(), kMaxJsonlDepth, where);
    json record;
    try {
      record = json::parse(line);
    } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
      throw std::runtime_error(where + ": malformed JSON (" + e.what() + ")");
    }
    if (!record.is_object()) {
      throw std::runtime_error(where + ": expected a JSON object, got " + describe(record));
    }
    const json* pair = &record;
    if (auto it = record.find("translation"); it != record.end()) {
      if (!it->is_object()) {
        throw std::runtime_error(where + ": \"translation\" must be an object, got " + describe(*it));
      }
      pair = &*it;
    }
    examples.push_back({field_string(*pair, "de", where), field_string(*pair, "en", where)});
  }
  if (in.bad()) throw std::runtime_error(origin + ": read error after line " + std::to_string(line_number));
  if (examples.empty() && limit > 0) {
    throw std::runtime_error("dataset file " + origin + " holds no examples (empty split)");
  }
  return examples;
}

std::vector<TranslationExample> read_fairseq_split(std::istream& de_in, const std::string& de_origin,
                                                   std::istream& en_in, const std::string& en_origin,
                                                   size_t limit) {
  std::vector<std::string> de = read_lines(de_in, de_origin);
  std::vector<std::string> en = read_lines(en_in, en_origin);
  if (de.size() != en.size()) {
    throw std::runtime_error("misaligned fairseq files: " + de_origin + " has " +
                             std::to_string(de.size()) + " lines but " + en_origin + " has " +
                             std::to_string(en.size()));
  }
  std::vector<TranslationExample> examples;
  for (size_t i = 0; i < de.size() && examples.size() < limit; ++i) {
    if (is_blank(de[i]) != is_blank(en[i])) {
      const std::string& blank = is_blank(de[i]) ? de_origin : en_origin;
      throw std::runtime_error(blank + ":" + std::to_string(i + 1) +
                               ": empty line where the other language has a sentence");
    }
    if (is_blank(de[i])) continue;  // a blank line on both sides (e.g. a trailing one)
    examples.push_back({std::move(de[i]), std::move(en[i])});
  }
  if (examples.empty() && limit > 0) {
    throw std::runtime_error("dataset files " + de_origin + " and " + en_origin +
                             " hold no sentences (empty split)");
  }
  return examples;
}

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
    for (size_t i = 0; i < splits[s]->size(); ++i) {
      const TranslationExample& example = (*splits[s])[i];
      nlohmann::json record = {{"translation", {{"de", example.de}, {"en", example.en}}}};
      try {
        out << record.dump() << '\n';
      } catch (const json::exception& e) {  // type_error 316: a sentence that is not UTF-8
        throw std::runtime_error("cannot write " + path.string() + ": pair " + std::to_string(i + 1) +
                                 " is not UTF-8 text (" + e.what() + ")");
      }
    }
    if (!out) throw std::runtime_error("error while writing " + path.string());
  }
}

}  // namespace harness::data
