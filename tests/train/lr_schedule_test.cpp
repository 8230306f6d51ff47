// Learning-rate schedules: literal values of warmup, cosine and linear decay and the floor, and
// every step's rate against transformers' own schedules, read from the project's Python
// environment (LambdaLR on a one-parameter optimizer).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include "harness/train/lr_schedule.h"

namespace harness::train {
namespace {

LrSchedule schedule(LrScheduleKind kind, int64_t warmup, double floor = 0.0) {
  LrSchedule s;
  s.kind = kind;
  s.warmup_steps = warmup;
  s.min_learning_rate = floor;
  return s;
}

TEST(LrScheduleTest, ParsesTheThreeNamesAndRefusesOthersNamingTheFlag) {
  EXPECT_EQ(parse_lr_schedule("constant"), LrScheduleKind::kConstant);
  EXPECT_EQ(parse_lr_schedule("cosine"), LrScheduleKind::kCosine);
  EXPECT_EQ(parse_lr_schedule("linear"), LrScheduleKind::kLinear);
  try {
    parse_lr_schedule("exponential");
    FAIL() << "accepted --lr_schedule exponential";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--lr_schedule exponential"), std::string::npos) << e.what();
  }
  for (auto kind : {LrScheduleKind::kConstant, LrScheduleKind::kCosine, LrScheduleKind::kLinear}) {
    EXPECT_EQ(parse_lr_schedule(to_string(kind)), kind);
  }
}

TEST(LrScheduleTest, LiteralValuesOfWarmupAndDecay) {
  const double peak = 1e-3;
  // 10 steps, 2 of warmup: 0, peak/2, then the decay over the 8 remaining steps.
  const LrSchedule cosine = schedule(LrScheduleKind::kCosine, 2);
  EXPECT_EQ(scheduled_learning_rate(cosine, peak, 0, 10), 0.0);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(cosine, peak, 1, 10), 5e-4);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(cosine, peak, 2, 10), 1e-3);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(cosine, peak, 6, 10), 5e-4);  // half way: cos(pi/2) = 0
  EXPECT_NEAR(scheduled_learning_rate(cosine, peak, 10, 10), 0.0, 1e-18);
  const LrSchedule linear = schedule(LrScheduleKind::kLinear, 2);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(linear, peak, 4, 10), 7.5e-4);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(linear, peak, 9, 10), 1.25e-4);
  EXPECT_EQ(scheduled_learning_rate(linear, peak, 12, 10), 0.0);  // past the end: clamped at 0
  // The floor lifts the decay, not the warmup.
  const LrSchedule floored = schedule(LrScheduleKind::kLinear, 2, 1e-4);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(floored, peak, 1, 10), 5e-4);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(floored, peak, 6, 10), 1e-4 + 9e-4 * 0.5);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(floored, peak, 10, 10), 1e-4);
  // Constant: the peak after any warmup; no warmup means every step at the peak.
  EXPECT_TRUE(schedule(LrScheduleKind::kConstant, 0).constant());
  EXPECT_FALSE(schedule(LrScheduleKind::kConstant, 3).constant());
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(schedule(LrScheduleKind::kConstant, 4), peak, 1, 10), 2.5e-4);
  EXPECT_EQ(scheduled_learning_rate(schedule(LrScheduleKind::kConstant, 4), peak, 7, 10), peak);
}

TEST(LrScheduleTest, RefusesANegativeWarmupAndAFloorOutsideZeroToThePeak) {
  EXPECT_THROW(validate_lr_schedule(schedule(LrScheduleKind::kCosine, -1), 1e-3), std::invalid_argument);
  try {
    validate_lr_schedule(schedule(LrScheduleKind::kCosine, 0, 2e-3), 1e-3);
    FAIL() << "accepted a floor above the peak";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--min_learning_rate 0.002"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--learning_rate 0.001"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(validate_lr_schedule(schedule(LrScheduleKind::kCosine, 5, 1e-3), 1e-3));
}

struct Case {
  LrScheduleKind kind;
  const char* function;
  double peak;
  int64_t warmup, total;
};

// Each case's rates, step by step, from transformers' get_{cosine,linear}_schedule_with_warmup as
// LambdaLR sets them on an optimizer's param group, printed with 17 significant digits (one
// Python process for all cases: importing transformers takes seconds).
std::vector<std::vector<double>> transformers_rates(const std::vector<Case>& cases) {
  const std::string python = std::string(HARNESS_SOURCE_DIR) + "/.venv/bin/python";
  if (!std::filesystem::exists(python)) {
    ADD_FAILURE() << "no Python environment at " << python << " (scripts/setup.sh installs it)";
    return {};
  }
  std::ostringstream script;
  script << std::setprecision(17) << "import torch, transformers\n"
         << "def rates(function, peak, warmup, total):\n"
         << "    p = torch.nn.Parameter(torch.zeros(1))\n"
         << "    o = torch.optim.AdamW([p], lr=peak)\n"
         << "    s = getattr(transformers, function)(o, warmup, total)\n"
         << "    out = []\n"
         << "    for _ in range(total):\n"
         << "        out.append(repr(o.param_groups[0]['lr']))\n"
         << "        o.step(); s.step()\n"
         << "    print(' '.join(out))\n";
  for (const Case& c : cases) {
    script << "rates('" << c.function << "', " << c.peak << ", " << c.warmup << ", " << c.total << ")\n";
  }
  const std::string path = std::filesystem::temp_directory_path().string() + "/lr_schedule_test_" +
                           std::to_string(::getpid()) + ".py";
  {
    std::FILE* file = std::fopen(path.c_str(), "w");
    std::fputs(script.str().c_str(), file);
    std::fclose(file);
  }
  std::FILE* pipe = ::popen((python + " -W ignore " + path + " 2>&1").c_str(), "r");
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe)) output += buffer;
  const int status = ::pclose(pipe);
  std::remove(path.c_str());
  if (status != 0) {
    ADD_FAILURE() << "transformers' schedules could not be run:\n" << output;
    return {};
  }
  std::vector<std::vector<double>> out;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream values(line);
    out.emplace_back();
    for (std::string v; values >> v;) out.back().push_back(std::stod(v));
  }
  return out;
}

TEST(LrScheduleTest, EveryStepEqualsTransformersSchedulesWithWarmup) {
  const std::vector<Case> cases = {Case{LrScheduleKind::kCosine, "get_cosine_schedule_with_warmup", 6e-4, 20, 137},
                                   Case{LrScheduleKind::kLinear, "get_linear_schedule_with_warmup", 6e-4, 20, 137},
                                   Case{LrScheduleKind::kCosine, "get_cosine_schedule_with_warmup", 1e-4, 0, 31},
                                   Case{LrScheduleKind::kLinear, "get_linear_schedule_with_warmup", 3e-3, 7, 7}};
  const std::vector<std::vector<double>> expected = transformers_rates(cases);
  ASSERT_EQ(expected.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    ASSERT_EQ(static_cast<int64_t>(expected[i].size()), c.total) << c.function;
    for (int64_t k = 0; k < c.total; ++k) {
      // The same double operations in the same order: equal, not merely close.
      EXPECT_EQ(scheduled_learning_rate(schedule(c.kind, c.warmup), c.peak, k, c.total), expected[i][k])
          << c.function << " warmup " << c.warmup << " of " << c.total << ", step " << k;
    }
  }
}

}  // namespace
}  // namespace harness::train
