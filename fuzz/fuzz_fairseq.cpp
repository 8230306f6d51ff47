// libFuzzer target for the fairseq reader (input: the .de file, NUL, the .en file; without a NUL
// both hold it all): read or refused with runtime_error, exportable, the same with a BOM or CRLF.
#include <cstddef>
#include <cstdint>
#include <cstring>
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

std::optional<std::vector<TranslationExample>> read(const std::string& de, const std::string& en) {
  return harness::fuzz::parsed_or_rejected([&] {
    std::istringstream de_in(de), en_in(en);
    return harness::data::read_fairseq_split(de_in, "fuzz/train.de", en_in, "fuzz/train.en",
                                             std::numeric_limits<size_t>::max());
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
  const char* text = reinterpret_cast<const char*>(data);
  const char* nul = static_cast<const char*>(std::memchr(text, '\0', size));
  const std::string de = nul ? std::string(text, nul) : std::string(text, size);
  const std::string en = nul ? std::string(nul + 1, text + size) : de;
  const auto examples = read(de, en);
  if (de.compare(0, 3, kByteOrderMark) != 0 && en.compare(0, 3, kByteOrderMark) != 0) {
    require(read(kByteOrderMark + de, kByteOrderMark + en) == examples,
            "a byte-order mark in front changes nothing");
  }
  if (de.find('\r') == std::string::npos && en.find('\r') == std::string::npos) {
    require(read(with_crlf(de), with_crlf(en)) == examples, "CRLF line ends change nothing");
  }
  if (!examples) return 0;
  for (const auto& example : *examples) {
    for (const std::string* sentence : {&example.de, &example.en}) {
      require(!sentence->empty(), "a sentence is not empty");
      require(sentence->find('\n') == std::string::npos, "a sentence is one line");
      require(sentence->back() != '\r', "a sentence has no CR line end");
    }
    // export_jsonl writes every loaded pair; dump() throws (and so aborts here) on non-UTF-8.
    nlohmann::json record = {{"translation", {{"de", example.de}, {"en", example.en}}}};
    require(!record.dump().empty(), "the pair serialises as JSON");
  }
  return 0;
}
