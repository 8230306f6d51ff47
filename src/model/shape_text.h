// "[2, 3]": a tensor shape as the model area's error messages print it.
#pragma once

#include <c10/util/ArrayRef.h>

#include <sstream>
#include <string>

namespace harness::model {

inline std::string shape_str(c10::IntArrayRef sizes) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << ']';
  return out.str();
}

}  // namespace harness::model
