// GPipe's clock schedule as plain data: which (micro-batch i, partition j) tasks may run together.
// The engine runs it as GPipe's forward and backward halves (gpipe_plan.h), the Pipe's plans,
// which keep exactly these cycles in unit time; nothing here knows about tensors or devices.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace harness::pipeline {

// One clock cycle: the (i, j) pairs that run concurrently, each on partition j's device.
using Cycle = std::vector<std::pair<int, int>>;

// Forward schedule for m micro-batches over n partitions: m + n - 1 cycles, cycle k holding every
// (i, j) with i + j == k, i descending. For m = 3, n = 3:
//
//   partition   k=0     k=1     k=2     k=3     k=4
//      0       (0,0)   (1,0)   (2,0)
//      1               (0,1)   (1,1)   (2,1)
//      2                       (0,2)   (1,2)   (2,2)
//
//   -> [(0,0)], [(1,0),(0,1)], [(2,0),(1,1),(0,2)], [(2,1),(1,2)], [(2,2)]
//
// Throws std::invalid_argument unless m >= 1 and n >= 1.
std::vector<Cycle> clock_cycles(int m, int n);

// Backward schedule: the forward clock run in reverse, so (i, j)'s backward comes after
// (i, j + 1)'s, which produces the gradient it needs. Cycle k holds every (i, j) with
// i + j == m + n - 2 - k, i ascending. For m = 3, n = 3:
//   [(2,2)], [(1,2),(2,1)], [(0,2),(1,1),(2,0)], [(0,1),(1,0)], [(0,0)]
std::vector<Cycle> backward_clock_cycles(int m, int n);

// The same schedules as tables: cell [j][k] is the micro-batch partition j runs at clock tick k,
// or kIdle. Built from clock_cycles / backward_clock_cycles, so they show what the Pipe runs.
constexpr int kIdle = -1;
using ClockTable = std::vector<std::vector<int>>;  // [partition][tick]

// Throws std::invalid_argument when a cycle names a partition outside [0, n) or puts two
// micro-batches on one partition in one tick.
ClockTable clock_table(const std::vector<Cycle>& cycles, int n);

struct ScheduleTable {
  int m = 0;  // micro-batches
  int n = 0;  // partitions (stages)
  ClockTable forward;
  ClockTable backward;

  int64_t total_slots() const;  // n * ticks, forward and backward together
  int64_t idle_slots() const;   // cells that are kIdle, forward and backward together
  // Idle slots over all slots: (n - 1) / (m + n - 1) for GPipe, e.g. 12/36 = 33.3% for n=4, m=6.
  double bubble_ratio() const;
};

ScheduleTable schedule_table(int m, int n);

// One table as text: a header of ticks, then one row per partition, micro-batch numbers, "."
// for idle. For m = 3, n = 2 (forward):
//   tick     0  1  2  3
//   stage 0  0  1  2  .
//   stage 1  .  0  1  2
std::string format_clock_table(const ClockTable& table);

// Rows "<row_label>j  cell cell ..." under a header row "<header_label>  h h ...", every cell
// padded to one width (at least 2) and the labels to the longest: the layout of every table and
// chart printed here and in training_schedule.h.
std::string format_rows(const std::string& header_label, const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows,
                        const std::string& row_label = "stage ");

// Forward then backward on one time line, F<i> / B<i> per slot, "." idle. For m = 3, n = 2:
//   clock    0  1  2  3  4  5  6  7
//   stage 0  F0 F1 F2 .  .  B2 B1 B0
//   stage 1  .  F0 F1 F2 B2 B1 B0 .
std::string gantt_chart(const ScheduleTable& schedule);

}  // namespace harness::pipeline
