// libFuzzer target for the safetensors parser: any input must either parse or raise
// std::runtime_error; anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "harness/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using harness::fuzz::require;
  const auto contents = harness::fuzz::parsed_or_rejected(
      [&] { return harness::model::parse_safetensors(data, size, "fuzz.safetensors"); });
  if (!contents) return 0;
  // Accepted files tile their data section exactly: the tensors' bytes add up to what follows
  // the header.
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  uint64_t tensor_bytes = 0;
  for (const auto& [name, tensor] : contents->tensors) {
    tensor_bytes += static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
  }
  require(tensor_bytes == size - 8 - header_len, "the tensors' bytes fill the data section");
  return 0;
}
