// A model named on the command line as a preset, optionally with its vocabulary: the tools that
// cost GPT-2 from its shapes (pipeline_balance, pipeline_schedule) read it alike, and their whole
// numbers (whole_integer).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "harness/model/config.h"

namespace harness::apps {

// `text` as a whole integer ("12"; not "12x", "", " 12" or past int64's range), or nothing.
inline std::optional<int64_t> whole_integer(const std::string& text) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used == 0 || used != text.size()) return std::nullopt;
  return value;
}

// "gpt2:50257" -> the gpt2 preset with vocab_size 50257; "gpt2-mini" -> the preset as it is.
// `what` names the item in errors ("--models item 'gpt2:x'"):
//   "--models item 'gpt2:x': the vocabulary after ':' is not a positive integer"
inline model::GPT2Config preset_with_vocabulary(const std::string& item, const std::string& what) {
  const size_t colon = item.find(':');
  model::GPT2Config config = model::GPT2Config::preset(item.substr(0, colon));
  if (colon != std::string::npos) {
    const std::optional<int64_t> vocab = whole_integer(item.substr(colon + 1));
    if (!vocab || *vocab < 1) {
      throw std::invalid_argument(what + ": the vocabulary after ':' is not a positive integer");
    }
    config.vocab_size = *vocab;
  }
  return config;
}

}  // namespace harness::apps
