// --precision: what torch.autocast does, for the threads that run a model's forward. Weights,
// gradients, the optimizer state and the master copy stay fp32; under bf16 the matmuls (linear,
// matmul, attention) run in bf16 while layer norm (its input is the fp32 residual stream), the
// softmax statistics and the loss are computed in fp32 (GPT-2's code upcasts where CPU autocast
// would not: see attention_with_dropout and weighted_cross_entropy).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace harness::model {

enum class Precision { kFp32, kBf16 };

// "fp32" | "bf16"; anything else (fp16 included: not offered, see README) is an
// std::invalid_argument naming --precision.
Precision parse_precision(const std::string& text);
std::string to_string(Precision precision);

// The dtype `precision` computes matmuls in (fp32 or bf16).
c10::ScalarType compute_dtype(Precision precision);

// RAII: autocast on `device_type` in `precision` for this thread, as `with torch.autocast(...)`
// (the previous state comes back on exit, nested scopes included; the cast cache is cleared when
// the outermost one ends). kFp32 does nothing. Each worker thread that runs a forward needs its
// own scope: autocast state is thread-local.
class AutocastScope {
 public:
  AutocastScope(Precision precision, c10::DeviceType device_type);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_type_;
  bool was_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::Float;
};

}  // namespace harness::model
