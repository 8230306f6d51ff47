// Internal to the readers of src/model and src/data: a nesting-depth check run before nlohmann::json
// sees untrusted text, whose copy and destruction recurse once per level (deep files overflow the stack).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace harness::model::detail {

// Throws std::runtime_error naming `origin` when brackets nest deeper than max_depth.
inline void check_json_nesting(const char* text, size_t length, int max_depth, const std::string& origin) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < length; ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) {
        throw std::runtime_error(origin + ": JSON nests more than " + std::to_string(max_depth) +
                                 " levels deep (at byte " + std::to_string(i) + ")");
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

}  // namespace harness::model::detail
