// libFuzzer target for data::Tokenizer::load (the input written to a scratch file): a model with
// the three specials or a runtime_error; a loaded model encodes and decodes a sentence.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "harness/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using harness::data::Tokenizer;
  using harness::fuzz::require;
  const std::string path = harness::fuzz::write_scratch("tokenizer.model", data, size);
  auto tokenizer = harness::fuzz::parsed_or_rejected([&] { return Tokenizer::load(path); });
  if (!tokenizer) return 0;
  const int64_t vocab = tokenizer->vocab_size();
  for (int64_t id : {tokenizer->eos_de_id(), tokenizer->eos_en_id(), tokenizer->pad_id()}) {
    require(id >= 0 && id < vocab, "special ids lie inside the vocabulary");
  }
  const auto ids = harness::fuzz::parsed_or_rejected(
      [&] { return tokenizer->encode("Guten Morgen .<eos_de>good morning .<eos_en><pad>"); });
  if (!ids) return 0;
  for (int64_t id : *ids) require(id >= 0 && id < vocab, "encoded ids lie inside the vocabulary");
  harness::fuzz::parsed_or_rejected([&] { return tokenizer->decode(*ids); });
  return 0;
}
