// --precision (see precision.h).
#include "harness/model/precision.h"

#include <ATen/autocast_mode.h>

#include <stdexcept>

namespace harness::model {

Precision parse_precision(const std::string& text) {
  if (text == "fp32") return Precision::kFp32;
  if (text == "bf16") return Precision::kBf16;
  if (text == "fp16") {
    throw std::invalid_argument("--precision fp16 is not offered (it needs dynamic loss scaling); use bf16, "
                                "which keeps fp32's exponent range");
  }
  throw std::invalid_argument("--precision '" + text + "': expected fp32 or bf16");
}

std::string to_string(Precision precision) { return precision == Precision::kBf16 ? "bf16" : "fp32"; }

c10::ScalarType compute_dtype(Precision precision) {
  return precision == Precision::kBf16 ? c10::ScalarType::BFloat16 : c10::ScalarType::Float;
}

AutocastScope::AutocastScope(Precision precision, c10::DeviceType device_type)
    : active_(precision != Precision::kFp32), device_type_(device_type) {
  if (!active_) return;
  was_enabled_ = at::autocast::is_autocast_enabled(device_type_);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_type_);
  at::autocast::set_autocast_enabled(device_type_, true);
  at::autocast::set_autocast_dtype(device_type_, compute_dtype(precision));
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, was_enabled_);
  at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
}

}  // namespace harness::model
