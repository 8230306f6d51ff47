// Blocks per pipeline stage: --balance parsing and checks, SPEC §4's default runs, and the exact
// min-max partition of measured block costs.
#include "harness/pipeline/balance.h"

#include "harness/pipeline/training_schedule.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace harness::pipeline {
namespace {

// "1 block", "12 blocks".
std::string count(int64_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string trim_blanks(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  const size_t last = text.find_last_not_of(" \t");
  return text.substr(first, last - first + 1);
}

// Items between commas, empty ones included: "3,,2" -> {"3", "", "2"}, "3," -> {"3", ""}.
std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    items.push_back(
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

bool all_digits(const std::string& text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The value as --balance would take it; an empty list would vanish from the message.
std::string flag_value(const std::vector<int>& balance) {
  return balance.empty() ? "''" : format_balance(balance);
}

void check_sizes(int blocks, int stages) {
  if (stages < 1) {
    throw std::invalid_argument(count(blocks, "block") + " over " + count(stages, "stage") +
                                ": need at least one stage");
  }
  if (blocks < stages) {
    throw std::invalid_argument(count(blocks, "block") + " over " + count(stages, "stage") +
                                ": every stage needs at least one block");
  }
}

std::string number(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

void check_cost(double cost, const std::string& what) {
  if (!std::isfinite(cost) || cost < 0) {
    throw std::invalid_argument("balance_by_cost: " + what + " is " + number(cost) +
                                "; costs must be finite and non-negative");
  }
}

// A split of the first blocks into the first stages, with each stage's cost.
struct Split {
  std::vector<int> balance;
  std::vector<double> costs;
};

template <typename T>
std::vector<T> sorted_descending(std::vector<T> values) {
  std::sort(values.begin(), values.end(), std::greater<T>());
  return values;
}

// The order of balance_by_cost's rule (header): costs from the most expensive, then block counts
// from the largest, then the balance itself, each lexicographically smallest.
bool better(const Split& a, const Split& b) {
  const auto a_costs = sorted_descending(a.costs);
  const auto b_costs = sorted_descending(b.costs);
  if (a_costs != b_costs) return a_costs < b_costs;
  const auto a_counts = sorted_descending(a.balance);
  const auto b_counts = sorted_descending(b.balance);
  if (a_counts != b_counts) return a_counts < b_counts;
  return a.balance < b.balance;
}

}  // namespace

BalanceSpec parse_balance(const std::string& text) {
  BalanceSpec spec;
  if (text.empty()) return spec;
  if (trim_blanks(text) == "auto") {
    spec.automatic = true;
    return spec;
  }
  const std::vector<std::string> items = split_commas(text);
  for (size_t n = 0; n < items.size(); ++n) {
    const std::string item = trim_blanks(items[n]);
    const std::string where = "--balance " + text + ": item " + std::to_string(n + 1);
    if (item.empty()) throw std::invalid_argument(where + " is empty");
    const std::string quoted = where + " ('" + item + "')";
    // "2.5": two blocks and a half, the cut between a block's attention and MLP halves.
    const bool half = item.size() > 2 && item.compare(item.size() - 2, 2, ".5") == 0;
    const std::string whole = half ? item.substr(0, item.size() - 2) : item;
    if (!all_digits(whole)) {
      // A lone word is most likely a misspelt keyword.
      throw std::invalid_argument(
          quoted + " is not a number of blocks (3, or 2.5 to cut a block between its halves)" +
          (items.size() == 1 ? " (--balance takes auto or blocks per stage, e.g. 3,3,2)" : ""));
    }
    int value = 0;
    const std::from_chars_result parsed =
        std::from_chars(whole.data(), whole.data() + whole.size(), value);
    if (parsed.ec == std::errc::result_out_of_range || value > std::numeric_limits<int>::max() / 2 - 1) {
      throw std::invalid_argument(quoted + " is too large (at most " +
                                  std::to_string(std::numeric_limits<int>::max() / 2 - 1) + ")");
    }
    if (value == 0 && !half) {
      throw std::invalid_argument(
          quoted + " is not a positive integer; every stage needs at least one block");
    }
    spec.halves_per_stage.push_back(2 * value + (half ? 1 : 0));
    if (!half) spec.blocks_per_stage.push_back(value);
  }
  if (spec.blocks_per_stage.size() != spec.halves_per_stage.size()) spec.blocks_per_stage.clear();
  return spec;
}

std::string balance_origin(const BalanceSpec& spec, bool pipelined) {
  if (spec.automatic) return " (auto, by time)";
  if (spec.given()) return "";
  return pipelined ? " (default, by cost)" : " (default)";
}

std::vector<int> default_balance(int blocks, int stages) {
  check_sizes(blocks, stages);
  const int64_t run = (static_cast<int64_t>(blocks) + stages - 1) / stages;
  const int64_t used = (blocks + run - 1) / run;  // stages that block k / run reaches
  if (used < stages) {
    const std::string empty =
        used + 1 == stages ? "stage " + std::to_string(used)
                           : "stages " + std::to_string(used) + " to " + std::to_string(stages - 1);
    throw std::invalid_argument(std::to_string(blocks) + " blocks over " + std::to_string(stages) +
                                " stages in runs of ceil(" + std::to_string(blocks) + "/" +
                                std::to_string(stages) + ") = " + std::to_string(run) + " leave " +
                                empty + " without a block; use --balance to place them, e.g. " +
                                format_balance(even_balance(blocks, stages)));
  }
  std::vector<int> balance;
  for (int j = 0; j < stages; ++j) {
    balance.push_back(static_cast<int>(std::min<int64_t>(run, blocks - j * run)));
  }
  return balance;
}

std::vector<int> even_balance(int blocks, int stages) {
  check_sizes(blocks, stages);
  std::vector<int> balance;
  for (int j = 0; j < stages; ++j) {
    balance.push_back(blocks / stages + (j < blocks % stages ? 1 : 0));
  }
  return balance;
}

std::vector<int> stage_halves(const StageSplitFlags& flags, int n_layer, int devices, const std::string& stages_from) {
  check_schedule_flags(flags.schedule, flags.micro_batches, devices, flags.virtual_stages);
  const int S = devices * flags.virtual_stages;
  if (!flags.balance_halves.empty()) {
    check_halves(flags.balance_halves, n_layer, S, stages_from);
    return flags.balance_halves;
  }
  std::vector<int> blocks = flags.balance;
  if (blocks.empty()) {
    try {
      blocks = default_balance(n_layer, S);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(stages_from + " = " + std::to_string(S) + " stages, but the model has " +
                                  std::to_string(n_layer) + " blocks (n_layer " + std::to_string(n_layer) +
                                  "): " + e.what());
    }
  }
  check_balance(blocks, n_layer, S, stages_from);
  std::vector<int> halves;
  for (int b : blocks) halves.push_back(2 * b);
  return halves;
}

namespace {

// check_balance's checks on `values`, stages' sizes in units that must sum to `total` (a model of
// `blocks` blocks), `blocks_text` writing a number of units in blocks as --balance takes them;
// `least` is what every stage needs.
void check_split(const std::vector<int>& values, int64_t total, int blocks, int stages, const std::string& stages_from,
                 const std::function<std::string(int64_t)>& blocks_text, const std::string& least) {
  std::string value;
  for (size_t j = 0; j < values.size(); ++j) value += (j > 0 ? "," : "") + blocks_text(values[j]);
  const std::string from = stages_from.empty() ? "" : " (" + stages_from + ")";
  const std::string flag = "--balance " + (value.empty() ? std::string("''") : value);
  if (stages < 1) {
    throw std::invalid_argument(flag + ": the pipeline has " + std::to_string(stages) + " stages" + from +
                                "; need at least one");
  }
  if (values.size() != static_cast<size_t>(stages)) {
    throw std::invalid_argument(flag + " gives " + count(static_cast<int64_t>(values.size()), "stage") +
                                " but the pipeline has " + std::to_string(stages) + from);
  }
  int64_t sum = 0;
  for (size_t j = 0; j < values.size(); ++j) {
    if (values[j] < 1) {
      // Below one unit: never a single block, so always "blocks".
      throw std::invalid_argument(flag + ": stage " + std::to_string(j) + " gets " + blocks_text(values[j]) +
                                  " blocks; every stage needs " + least);
    }
    sum += values[j];
  }
  if (sum != total) {
    throw std::invalid_argument(flag + " sums to " + blocks_text(sum) + " but the model has " + count(blocks, "block"));
  }
}

}  // namespace

void check_balance(const std::vector<int>& balance, int blocks, int stages,
                   const std::string& stages_from) {
  check_split(balance, blocks, blocks, stages, stages_from, [](int64_t n) { return std::to_string(n); },
              "at least one");
}

void check_halves(const std::vector<int>& halves, int n_layer, int stages, const std::string& stages_from) {
  // n half blocks as --balance writes them: 3 -> "1.5", -1 -> "-0.5".
  const auto blocks_text = [](int64_t n) {
    return std::string(n < 0 ? "-" : "") + std::to_string((n < 0 ? -n : n) / 2) + (n % 2 != 0 ? ".5" : "");
  };
  check_split(halves, 2 * static_cast<int64_t>(n_layer), n_layer, stages, stages_from, blocks_text,
              "half a block at least");
}

std::vector<int> balance_by_cost(const std::vector<double>& block_costs, int stages,
                                 double first_stage_extra, double last_stage_extra) {
  const int blocks = static_cast<int>(block_costs.size());
  check_sizes(blocks, stages);
  for (int k = 0; k < blocks; ++k) check_cost(block_costs[k], "block " + std::to_string(k));
  check_cost(first_stage_extra, "first_stage_extra");
  check_cost(last_stage_extra, "last_stage_extra");
  double total = first_stage_extra + last_stage_extra;
  for (double cost : block_costs) total += cost;
  if (!std::isfinite(total)) {
    throw std::invalid_argument("balance_by_cost: the costs sum to " + number(total) +
                                "; rescale them");
  }

  // run_sum[j][k]: blocks j..k-1 summed in block order, so a run's cost is the same double
  // wherever it is looked at.
  std::vector<std::vector<double>> run_sum(blocks + 1, std::vector<double>(blocks + 1, 0.0));
  for (int j = 0; j < blocks; ++j) {
    for (int k = j + 1; k <= blocks; ++k) run_sum[j][k] = run_sum[j][k - 1] + block_costs[k - 1];
  }
  auto stage_cost = [&](int stage, int j, int k) {
    double cost = run_sum[j][k];
    if (stage == 0) cost += first_stage_extra;
    if (stage == stages - 1) cost += last_stage_extra;
    return cost;
  };

  // best[s][k]: the best split of blocks 0..k-1 into stages 0..s-1 (s >= 1), for k that leave at
  // least one block to each later stage.
  std::vector<std::vector<std::optional<Split>>> best(
      stages + 1, std::vector<std::optional<Split>>(blocks + 1));
  for (int k = 1; k <= blocks - (stages - 1); ++k) {
    best[1][k] = Split{{k}, {stage_cost(0, 0, k)}};
  }
  for (int s = 2; s <= stages; ++s) {
    for (int k = s; k <= blocks - (stages - s); ++k) {
      if (s == stages && k != blocks) continue;  // only the last stage may end at the last block
      for (int j = s - 1; j < k; ++j) {
        if (!best[s - 1][j]) continue;
        Split candidate = *best[s - 1][j];
        candidate.balance.push_back(k - j);
        candidate.costs.push_back(stage_cost(s - 1, j, k));
        if (!best[s][k] || better(candidate, *best[s][k])) best[s][k] = std::move(candidate);
      }
    }
  }
  return best[stages][blocks]->balance;
}

std::vector<int> stage_of_each_block(const std::vector<int>& balance) {
  std::vector<int> stage_of;
  for (size_t j = 0; j < balance.size(); ++j) {
    if (balance[j] < 1) {
      throw std::invalid_argument("stage_of_each_block(" + flag_value(balance) + "): stage " +
                                  std::to_string(j) + " gets " + count(balance[j], "block"));
    }
    stage_of.insert(stage_of.end(), static_cast<size_t>(balance[j]), static_cast<int>(j));
  }
  return stage_of;
}

std::string format_balance(const std::vector<int>& balance) {
  std::string out;
  for (size_t j = 0; j < balance.size(); ++j) {
    if (j > 0) out += ",";
    out += std::to_string(balance[j]);
  }
  return out;
}

std::string format_halves(const std::vector<int>& halves) {
  std::string text;
  for (size_t s = 0; s < halves.size(); ++s) {
    text += (s ? "," : "") + std::to_string(halves[s] / 2) + (halves[s] % 2 ? ".5" : "");
  }
  return text;
}

}  // namespace harness::pipeline
