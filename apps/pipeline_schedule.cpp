// pipeline_schedule: prints GPipe's forward and backward clock tables for S stages and M
// micro-batches, the Gantt chart of one training step and its bubble ratio, all from the schedule
// Pipe executes (harness/pipeline/schedule.h).
#include <cxxopts.hpp>

#include <cstdio>
#include <iostream>

#include "harness/pipeline/schedule.h"

int main(int argc, char** argv) {
  using namespace harness::pipeline;
  cxxopts::Options options("pipeline_schedule",
                           "GPipe clock tables, Gantt chart and bubble ratio for S stages, M micro-batches");
  options.add_options()
      ("stages", "pipeline stages (partitions) S", cxxopts::value<int>()->default_value("4"))
      ("micro_batches", "micro-batches per batch M", cxxopts::value<int>()->default_value("6"))
      ("h,help", "this help");
  int s = 0, m = 0;
  try {
    const cxxopts::ParseResult result = options.parse(argc, argv);
    if (result.count("help")) {
      std::cout << options.help() << std::endl;
      return 0;
    }
    if (!result.unmatched().empty()) {
      throw std::invalid_argument("unexpected argument '" + result.unmatched().front() + "'");
    }
    s = result["stages"].as<int>();
    m = result["micro_batches"].as<int>();
    if (s < 1) throw std::invalid_argument("--stages " + std::to_string(s) + " must be at least 1");
    if (m < 1) {
      throw std::invalid_argument("--micro_batches " + std::to_string(m) + " must be at least 1");
    }
  } catch (const std::exception& e) {
    std::cerr << "pipeline_schedule: " << e.what() << "\n(see --help)" << std::endl;
    return 2;
  }

  const ScheduleTable schedule = schedule_table(m, s);
  std::cout << "GPipe schedule: S=" << s << " stages, M=" << m << " micro-batches, "
            << m + s - 1 << " clock ticks forward and as many backward\n\n";
  std::cout << "Forward clock table (micro-batch run by each stage at each tick, . = idle):\n"
            << format_clock_table(schedule.forward) << "\n";
  std::cout << "Backward clock table:\n" << format_clock_table(schedule.backward) << "\n";
  std::cout << "Gantt chart of one step (F<i> forward, B<i> backward of micro-batch i, . = idle):\n"
            << gantt_chart(schedule) << "\n";
  char line[256];
  std::snprintf(line, sizeof(line),
                "Bubble ratio: %lld idle of %lld slots = %.1f%% ((S-1)/(M+S-1) = %d/%d); "
                "ideal speedup over one stage S*M/(M+S-1) = %.2fx\n",
                static_cast<long long>(schedule.idle_slots()),
                static_cast<long long>(schedule.total_slots()), 100.0 * schedule.bubble_ratio(),
                s - 1, m + s - 1, static_cast<double>(s) * m / (m + s - 1));
  std::cout << line;
  return 0;
}
