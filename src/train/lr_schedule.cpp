// Learning-rate schedules (see lr_schedule.h).
#include "harness/train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "harness/train/run/report.h"

namespace harness::train {

LrScheduleKind parse_lr_schedule(const std::string& text) {
  if (text == "constant") return LrScheduleKind::kConstant;
  if (text == "cosine") return LrScheduleKind::kCosine;
  if (text == "linear") return LrScheduleKind::kLinear;
  throw std::invalid_argument("--lr_schedule " + text + ": expected constant, cosine or linear");
}

std::string to_string(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::kConstant: return "constant";
    case LrScheduleKind::kCosine: return "cosine";
    case LrScheduleKind::kLinear: return "linear";
  }
  return "constant";
}

double scheduled_learning_rate(const LrSchedule& schedule, double peak, int64_t step, int64_t training_steps) {
  const int64_t warmup = schedule.warmup_steps;
  if (step < warmup) {
    return peak * (static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup)));
  }
  if (schedule.kind == LrScheduleKind::kConstant) return peak;
  // transformers computes the factor first and LambdaLR multiplies the base rate by it; the same
  // order here gives the same doubles.
  double factor = 0.0;
  if (schedule.kind == LrScheduleKind::kCosine) {
    const double progress = static_cast<double>(step - warmup) /
                            static_cast<double>(std::max<int64_t>(1, training_steps - warmup));
    factor = std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * 0.5 * 2.0 * progress)));
  } else {
    factor = std::max(0.0, static_cast<double>(training_steps - step) /
                               static_cast<double>(std::max<int64_t>(1, training_steps - warmup)));
  }
  const double floor = schedule.min_learning_rate;
  return floor == 0.0 ? peak * factor : floor + (peak - floor) * factor;
}

void validate_lr_schedule(const LrSchedule& schedule, double peak) {
  if (schedule.warmup_steps < 0) {
    throw std::invalid_argument("--warmup_steps must be >= 0, got " + std::to_string(schedule.warmup_steps));
  }
  if (schedule.min_learning_rate < 0.0 || schedule.min_learning_rate > peak) {
    throw std::invalid_argument("--min_learning_rate " + format_number(schedule.min_learning_rate) +
                                " must be between 0 and --learning_rate " + format_number(peak));
  }
}

}  // namespace harness::train
