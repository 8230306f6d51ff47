// Helpers the pipeline test files share.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>

namespace harness::pipeline::testing {

// The message of the std::invalid_argument `call` throws, or a note that it threw none.
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument thrown)";
}

}  // namespace harness::pipeline::testing
