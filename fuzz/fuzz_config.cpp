// libFuzzer target for GPT2Config::from_json_string (config.json): a valid config or a
// runtime_error; a parsed config survives to_json_string and its derived sizes do not overflow.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "harness/model/config.h"

namespace {

bool same(const harness::model::GPT2Config& a, const harness::model::GPT2Config& b) {
  return a.vocab_size == b.vocab_size && a.n_positions == b.n_positions && a.n_embd == b.n_embd &&
         a.n_layer == b.n_layer && a.n_head == b.n_head && a.n_inner == b.n_inner &&
         a.layer_norm_epsilon == b.layer_norm_epsilon && a.embd_pdrop == b.embd_pdrop &&
         a.attn_pdrop == b.attn_pdrop && a.resid_pdrop == b.resid_pdrop &&
         a.initializer_range == b.initializer_range && a.bos_token_id == b.bos_token_id &&
         a.eos_token_id == b.eos_token_id;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using harness::model::GPT2Config;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto config = harness::fuzz::parsed_or_rejected(
      [&] { return GPT2Config::from_json_string(text, "fuzz/config.json"); });
  if (!config) return 0;
  config->validate();  // throws std::invalid_argument, and so aborts, if parsing let a bad value by
  // The model computes these from every accepted config (UBSan reports an overflow).
  harness::fuzz::require(config->inner_dim() > 0 && config->head_dim() > 0, "positive derived sizes");
  const GPT2Config again = GPT2Config::from_json_string(config->to_json_string(), "fuzz/written.json");
  harness::fuzz::require(same(*config, again), "config.json round trip keeps every field");
  return 0;
}
