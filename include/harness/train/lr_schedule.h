// The learning rate of each optimizer step: constant, or linear warmup from 0 followed by a cosine
// or linear decay, with the values of Hugging Face transformers' get_cosine_schedule_with_warmup
// and get_linear_schedule_with_warmup (a LambdaLR factor times the peak rate). Pure: no torch.
#pragma once

#include <cstdint>
#include <string>

namespace harness::train {

enum class LrScheduleKind { kConstant, kCosine, kLinear };

// "constant" | "cosine" | "linear"; anything else is an std::invalid_argument naming --lr_schedule.
LrScheduleKind parse_lr_schedule(const std::string& text);
std::string to_string(LrScheduleKind kind);

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kConstant;
  int64_t warmup_steps = 0;       // linear from 0 to the peak over these steps
  double min_learning_rate = 0.0;  // the decay's floor
  // Whether every step runs at the peak rate (no warmup, no decay).
  bool constant() const { return kind == LrScheduleKind::kConstant && warmup_steps == 0; }
};

// The rate of optimizer step `step` (0 for the first) of a run of `training_steps` steps:
//   warmup (step < W):  peak * step / max(1, W)            (the first step's rate is 0)
//   then, with progress p = (step - W) / max(1, training_steps - W),
//     cosine:  min + (peak - min) * max(0, (1 + cos(pi p)) / 2)
//     linear:  min + (peak - min) * max(0, 1 - p)
//     constant: peak
// With min 0, transformers' schedules exactly (the same double arithmetic).
double scheduled_learning_rate(const LrSchedule& schedule, double peak, int64_t step, int64_t training_steps);

// The flags' rules, checked before training: --warmup_steps >= 0, 0 <= --min_learning_rate <=
// --learning_rate. Errors name the flag and the value.
void validate_lr_schedule(const LrSchedule& schedule, double peak);

}  // namespace harness::train
