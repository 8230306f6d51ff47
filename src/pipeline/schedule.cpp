// GPipe clock cycles, and the same schedule as tables, bubble ratio and Gantt chart.
#include "harness/pipeline/schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace harness::pipeline {
namespace {

std::string pad_right(std::string text, size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

std::string rtrim(std::string line) {
  line.erase(line.find_last_not_of(' ') + 1);
  return line;
}

}  // namespace

std::string format_rows(const std::string& header_label, const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows, const std::string& row_label) {
  size_t width = 2;
  for (const auto& cell : header) width = std::max(width, cell.size());
  for (const auto& row : rows) {
    for (const auto& cell : row) width = std::max(width, cell.size());
  }
  const std::string last_label = row_label + std::to_string(rows.empty() ? 0 : rows.size() - 1);
  const size_t label_width = std::max(header_label.size(), last_label.size());
  auto line = [&](const std::string& label, const std::vector<std::string>& cells) {
    std::string text = pad_right(label, label_width) + " ";
    for (const auto& cell : cells) text += " " + pad_right(cell, width);
    return rtrim(text) + "\n";
  };
  std::string out = line(header_label, header);
  for (size_t j = 0; j < rows.size(); ++j) out += line(row_label + std::to_string(j), rows[j]);
  return out;
}

namespace {

std::vector<std::string> tick_labels(size_t from, size_t count) {
  std::vector<std::string> labels;
  for (size_t k = 0; k < count; ++k) labels.push_back(std::to_string(from + k));
  return labels;
}

}  // namespace

std::vector<Cycle> clock_cycles(int m, int n) {
  if (m < 1 || n < 1) {
    throw std::invalid_argument("clock_cycles: need at least one micro-batch and one partition, got m=" +
                                std::to_string(m) + ", n=" + std::to_string(n));
  }
  std::vector<Cycle> cycles(m + n - 1);
  for (int k = 0; k < m + n - 1; ++k) {
    for (int i = std::min(k, m - 1); i >= 0 && k - i < n; --i) cycles[k].emplace_back(i, k - i);
  }
  return cycles;
}

std::vector<Cycle> backward_clock_cycles(int m, int n) {
  std::vector<Cycle> cycles = clock_cycles(m, n);
  std::reverse(cycles.begin(), cycles.end());
  for (Cycle& cycle : cycles) std::reverse(cycle.begin(), cycle.end());
  return cycles;
}

ClockTable clock_table(const std::vector<Cycle>& cycles, int n) {
  if (n < 1) throw std::invalid_argument("clock_table: n=" + std::to_string(n) + " partitions");
  ClockTable table(static_cast<size_t>(n), std::vector<int>(cycles.size(), kIdle));
  for (size_t k = 0; k < cycles.size(); ++k) {
    for (const auto& [i, j] : cycles[k]) {
      if (j < 0 || j >= n) {
        throw std::invalid_argument("clock_table: tick " + std::to_string(k) + " puts micro-batch " +
                                    std::to_string(i) + " on partition " + std::to_string(j) +
                                    ", outside [0, " + std::to_string(n) + ")");
      }
      int& cell = table[static_cast<size_t>(j)][k];
      if (cell != kIdle) {
        throw std::invalid_argument("clock_table: tick " + std::to_string(k) + " runs micro-batches " +
                                    std::to_string(cell) + " and " + std::to_string(i) +
                                    " both on partition " + std::to_string(j));
      }
      cell = i;
    }
  }
  return table;
}

ScheduleTable schedule_table(int m, int n) {
  ScheduleTable schedule;
  schedule.m = m;
  schedule.n = n;
  schedule.forward = clock_table(clock_cycles(m, n), n);
  schedule.backward = clock_table(backward_clock_cycles(m, n), n);
  return schedule;
}

int64_t ScheduleTable::total_slots() const {
  int64_t total = 0;
  for (const ClockTable* table : {&forward, &backward}) {
    for (const auto& row : *table) total += static_cast<int64_t>(row.size());
  }
  return total;
}

int64_t ScheduleTable::idle_slots() const {
  int64_t idle = 0;
  for (const ClockTable* table : {&forward, &backward}) {
    for (const auto& row : *table) idle += std::count(row.begin(), row.end(), kIdle);
  }
  return idle;
}

double ScheduleTable::bubble_ratio() const {
  const int64_t total = total_slots();
  return total == 0 ? 0.0 : static_cast<double>(idle_slots()) / static_cast<double>(total);
}

std::string format_clock_table(const ClockTable& table) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& row : table) {
    rows.emplace_back();
    for (int i : row) rows.back().push_back(i == kIdle ? "." : std::to_string(i));
  }
  return format_rows("tick", tick_labels(0, table.empty() ? 0 : table[0].size()), rows);
}

std::string gantt_chart(const ScheduleTable& schedule) {
  std::vector<std::vector<std::string>> rows(schedule.forward.size());
  size_t ticks = 0;
  for (size_t j = 0; j < rows.size(); ++j) {
    for (int i : schedule.forward[j]) rows[j].push_back(i == kIdle ? "." : "F" + std::to_string(i));
    for (int i : schedule.backward[j]) rows[j].push_back(i == kIdle ? "." : "B" + std::to_string(i));
    ticks = rows[j].size();
  }
  return format_rows("clock", tick_labels(0, ticks), rows);
}

}  // namespace harness::pipeline
