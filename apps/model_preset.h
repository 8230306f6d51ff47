// A model named on the command line as a preset, optionally with its vocabulary: the tools that
// cost GPT-2 from its shapes (pipeline_balance, pipeline_schedule) read it alike.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "harness/model/config.h"

namespace harness::apps {

// "gpt2:50257" -> the gpt2 preset with vocab_size 50257; "gpt2-mini" -> the preset as it is.
// `what` names the item in errors ("--models item 'gpt2:x'"):
//   "--models item 'gpt2:x': the vocabulary after ':' is not a positive integer"
inline model::GPT2Config preset_with_vocabulary(const std::string& item, const std::string& what) {
  const size_t colon = item.find(':');
  model::GPT2Config config = model::GPT2Config::preset(item.substr(0, colon));
  if (colon != std::string::npos) {
    const std::string vocab = item.substr(colon + 1);
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(vocab, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != vocab.size() || value < 1) {
      throw std::invalid_argument(what + ": the vocabulary after ':' is not a positive integer");
    }
    config.vocab_size = value;
  }
  return config;
}

}  // namespace harness::apps
