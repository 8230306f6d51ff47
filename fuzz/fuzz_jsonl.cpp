// libFuzzer target for the JSON Lines reader: every input is read or refused with runtime_error,
// reads back unchanged after export_jsonl's format, and reads the same with a BOM or CRLF ends.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "harness/data/dataset.h"

namespace {

using harness::data::TranslationExample;
const std::string kByteOrderMark = "\xEF\xBB\xBF";

std::optional<std::vector<TranslationExample>> read(const std::string& text) {
  return harness::fuzz::parsed_or_rejected([&] {
    std::istringstream in(text);
    return harness::data::read_jsonl_split(in, "fuzz/train.jsonl", std::numeric_limits<size_t>::max());
  });
}

std::string with_crlf(const std::string& text) {
  std::string out;
  for (char c : text) out += c == '\n' ? std::string("\r\n") : std::string(1, c);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using harness::fuzz::require;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto examples = read(text);
  if (text.compare(0, 3, kByteOrderMark) != 0) {
    require(read(kByteOrderMark + text) == examples, "a byte-order mark in front changes nothing");
  }
  if (text.find('\r') == std::string::npos) {
    require(read(with_crlf(text)) == examples, "CRLF line ends change nothing");
  }
  if (!examples) return 0;
  // What export_jsonl writes for these pairs reads back as the same pairs (dump() would throw on
  // a string that is not UTF-8, which aborts here).
  std::string written;
  for (const auto& example : *examples) {
    nlohmann::json record = {{"translation", {{"de", example.de}, {"en", example.en}}}};
    written += record.dump() + "\n";
  }
  require(read(written) == examples, "exported pairs read back unchanged");
  return 0;
}
