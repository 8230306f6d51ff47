// libFuzzer target for the safetensors parser: any input must either parse or raise
// std::runtime_error; anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <stdexcept>

#include "harness/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    harness::model::parse_safetensors(data, size, "fuzz");
  } catch (const std::runtime_error&) {
    // The documented way to reject a malformed file.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception type: %s\n", e.what());
    std::abort();
  }
  return 0;
}
