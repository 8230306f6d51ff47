// --balance parsing and checks, SPEC §4's default runs and balance_by_cost against hand-worked
// tables; balance_by_cost also against every partition of small inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "harness/pipeline/balance.h"

#include "test_support.h"

namespace harness::pipeline {
namespace {

using testing::error_of;

std::vector<double> equal_costs(int blocks, double cost) {
  return std::vector<double>(static_cast<size_t>(blocks), cost);
}

TEST(Balance, ParseAutoEmptyAndLists) {
  EXPECT_TRUE(parse_balance("auto").automatic);
  EXPECT_TRUE(parse_balance("auto").blocks_per_stage.empty());
  EXPECT_TRUE(parse_balance(" auto ").automatic);

  const BalanceSpec unset = parse_balance("");
  EXPECT_FALSE(unset.automatic);
  EXPECT_TRUE(unset.blocks_per_stage.empty());

  const struct {
    std::string text;
    std::vector<int> blocks_per_stage;
  } cases[] = {
      {"3,3,2", {3, 3, 2}},
      {"12", {12}},
      {"3, 3, 2", {3, 3, 2}},      // blanks around items are ignored
      {" 1 ,\t2 ", {1, 2}},        // tabs too
      {"03,4", {3, 4}},            // decimal digits, leading zeros harmless
      {"1073741822", {1073741822}},  // the largest: twice it plus a half still fits an int
  };
  for (const auto& c : cases) {
    const BalanceSpec spec = parse_balance(c.text);
    EXPECT_FALSE(spec.automatic) << c.text;
    EXPECT_EQ(spec.blocks_per_stage, c.blocks_per_stage) << c.text;
  }
}

TEST(Balance, ParseHalfBlocks) {
  const BalanceSpec cut = parse_balance("2.5,1.5");
  EXPECT_EQ(cut.halves_per_stage, (std::vector<int>{5, 3}));
  EXPECT_TRUE(cut.blocks_per_stage.empty()) << "not expressible in whole blocks";
  EXPECT_EQ(parse_balance("0.5, 3").halves_per_stage, (std::vector<int>{1, 6}));
  const BalanceSpec whole = parse_balance("3,1");
  EXPECT_EQ(whole.halves_per_stage, (std::vector<int>{6, 2}));
  EXPECT_EQ(whole.blocks_per_stage, (std::vector<int>{3, 1}));
  EXPECT_THROW(parse_balance("2.25"), std::invalid_argument);
  EXPECT_THROW(parse_balance(".5"), std::invalid_argument);
  EXPECT_THROW(parse_balance("2.50"), std::invalid_argument);
  EXPECT_EQ(format_halves({5, 3}), "2.5,1.5");
  EXPECT_EQ(format_halves({4, 4}), "2,2");
  EXPECT_EQ(format_halves({1}), "0.5");
  for (const std::vector<int>& halves : {std::vector<int>{5, 3}, std::vector<int>{1, 7, 2}}) {
    EXPECT_EQ(parse_balance(format_halves(halves)).halves_per_stage, halves);
  }
}

TEST(Balance, ParseRejectsWithFlagValueAndItem) {
  const struct {
    std::string text;
    std::string message;
  } cases[] = {
      {"3,x,2", "--balance 3,x,2: item 2 ('x') is not a number of blocks (3, or 2.5 to cut a block between its halves)"},
      {"3,,2", "--balance 3,,2: item 2 is empty"},
      {"3,3,", "--balance 3,3,: item 3 is empty"},
      {",3", "--balance ,3: item 1 is empty"},
      {"3, ,2", "--balance 3, ,2: item 2 is empty"},
      {"  ", "--balance   : item 1 is empty"},
      {"-1", "--balance -1: item 1 ('-1') is not a number of blocks (3, or 2.5 to cut a block between its halves) (--balance takes auto or "
             "blocks per stage, e.g. 3,3,2)"},
      {"3,-1", "--balance 3,-1: item 2 ('-1') is not a number of blocks (3, or 2.5 to cut a block between its halves)"},
      {"0", "--balance 0: item 1 ('0') is not a positive integer; every stage needs at least one "
            "block"},
      {"3,0,2", "--balance 3,0,2: item 2 ('0') is not a positive integer; every stage needs at "
                "least one block"},
      {"99999999999", "--balance 99999999999: item 1 ('99999999999') is too large (at most "
                      "1073741822)"},
      {"2,2147483648", "--balance 2,2147483648: item 2 ('2147483648') is too large (at most "
                       "1073741822)"},
      {"+3,3", "--balance +3,3: item 1 ('+3') is not a number of blocks (3, or 2.5 to cut a block between its halves)"},
      {"3.0,3", "--balance 3.0,3: item 1 ('3.0') is not a number of blocks (3, or 2.5 to cut a block between its halves)"},
      {"3 3,2", "--balance 3 3,2: item 1 ('3 3') is not a number of blocks (3, or 2.5 to cut a block between its halves)"},
      {"Auto", "--balance Auto: item 1 ('Auto') is not a number of blocks (3, or 2.5 to cut a block between its halves) (--balance takes auto or "
               "blocks per stage, e.g. 3,3,2)"},
      {"auto,3", "--balance auto,3: item 1 ('auto') is not a number of blocks (3, or 2.5 to cut a block between its halves)"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(error_of([&] { parse_balance(c.text); }), c.message) << c.text;
  }
}

TEST(Balance, DefaultIsSpecModelParallelRuns) {
  const struct {
    int blocks, stages;
    std::vector<int> balance;
  } cases[] = {
      {12, 1, {12}},
      {12, 2, {6, 6}},
      {12, 3, {4, 4, 4}},
      {12, 4, {3, 3, 3, 3}},
      {10, 4, {3, 3, 3, 1}},  // ceil(10/4) = 3, the last stage gets the rest
      {7, 3, {3, 3, 1}},
      {4, 4, {1, 1, 1, 1}},
      {48, 5, {10, 10, 10, 10, 8}},
      {2, 1, {2}},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(default_balance(c.blocks, c.stages), c.balance)
        << c.blocks << " blocks over " << c.stages << " stages";
  }
}

TEST(Balance, DefaultRejectsEmptyStagesSuggestingAnEvenBalance) {
  EXPECT_EQ(error_of([] { default_balance(12, 5); }),
            "12 blocks over 5 stages in runs of ceil(12/5) = 3 leave stage 4 without a block; use "
            "--balance to place them, e.g. 3,3,2,2,2");
  EXPECT_EQ(error_of([] { default_balance(10, 8); }),
            "10 blocks over 8 stages in runs of ceil(10/8) = 2 leave stages 5 to 7 without a "
            "block; use --balance to place them, e.g. 2,2,1,1,1,1,1,1");
  EXPECT_EQ(error_of([] { default_balance(3, 4); }),
            "3 blocks over 4 stages: every stage needs at least one block");
  EXPECT_EQ(error_of([] { default_balance(12, 0); }),
            "12 blocks over 0 stages: need at least one stage");
  EXPECT_EQ(error_of([] { default_balance(0, 1); }),
            "0 blocks over 1 stage: every stage needs at least one block");
}

TEST(Balance, EvenPutsTheRemainderFirst) {
  EXPECT_EQ(even_balance(12, 5), (std::vector<int>{3, 3, 2, 2, 2}));
  EXPECT_EQ(even_balance(12, 4), (std::vector<int>{3, 3, 3, 3}));
  EXPECT_EQ(even_balance(10, 8), (std::vector<int>{2, 2, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(even_balance(5, 5), (std::vector<int>{1, 1, 1, 1, 1}));
  EXPECT_EQ(error_of([] { even_balance(2, 3); }),
            "2 blocks over 3 stages: every stage needs at least one block");
}

TEST(Balance, CheckAcceptsAMatchingBalance) {
  EXPECT_NO_THROW(check_balance({3, 3, 2}, 8, 3, "devices 3"));
  EXPECT_NO_THROW(check_balance({12}, 12, 1, ""));
  EXPECT_NO_THROW(check_balance(default_balance(10, 4), 10, 4, "devices 4"));
}

TEST(Balance, CheckRejectsWithTheValues) {
  EXPECT_EQ(error_of([] { check_balance({6, 6}, 12, 4, "devices 2 x virtual stages 2"); }),
            "--balance 6,6 gives 2 stages but the pipeline has 4 (devices 2 x virtual stages 2)");
  EXPECT_EQ(error_of([] { check_balance({12}, 12, 2, ""); }),
            "--balance 12 gives 1 stage but the pipeline has 2");
  EXPECT_EQ(error_of([] { check_balance({3, 3, 3, 3}, 10, 4, "devices 4"); }),
            "--balance 3,3,3,3 sums to 12 but the model has 10 blocks");
  EXPECT_EQ(error_of([] { check_balance({1}, 2, 1, ""); }),
            "--balance 1 sums to 1 but the model has 2 blocks");
  EXPECT_EQ(error_of([] { check_balance({3, 0, 2}, 5, 3, "devices 3"); }),
            "--balance 3,0,2: stage 1 gets 0 blocks; every stage needs at least one");
  EXPECT_EQ(error_of([] { check_balance({3, -1, 8}, 10, 3, "devices 3"); }),
            "--balance 3,-1,8: stage 1 gets -1 blocks; every stage needs at least one");
  EXPECT_EQ(error_of([] { check_balance({}, 12, 2, "devices 2"); }),
            "--balance '' gives 0 stages but the pipeline has 2 (devices 2)");
  EXPECT_EQ(error_of([] { check_balance({}, 12, 0, "devices 0"); }),
            "--balance '': the pipeline has 0 stages (devices 0); need at least one");
  // The sum is taken without overflow.
  EXPECT_EQ(error_of([] { check_balance({2147483647, 2147483647}, 12, 2, ""); }),
            "--balance 2147483647,2147483647 sums to 4294967294 but the model has 12 blocks");
}

TEST(Balance, CheckHalvesNamesTheValuesInBlocks) {
  EXPECT_NO_THROW(check_halves({5, 3}, 4, 2, ""));
  EXPECT_EQ(error_of([] { check_halves({3, 4}, 4, 2, ""); }), "--balance 1.5,2 sums to 3.5 but the model has 4 blocks");
  EXPECT_EQ(error_of([] { check_halves({2, 6}, 4, 4, "--pipeline_parallel_size 2 x --virtual_stages 2"); }),
            "--balance 1,3 gives 2 stages but the pipeline has 4 (--pipeline_parallel_size 2 x --virtual_stages 2)");
  EXPECT_EQ(error_of([] { check_halves({1, 0, 7}, 4, 3, ""); }),
            "--balance 0.5,0,3.5: stage 1 gets 0 blocks; every stage needs half a block at least");
  EXPECT_EQ(error_of([] { check_halves({3, -1, 6}, 4, 3, ""); }),
            "--balance 1.5,-0.5,3: stage 1 gets -0.5 blocks; every stage needs half a block at least");
  EXPECT_EQ(error_of([] { check_halves({}, 4, 0, "devices 0"); }),
            "--balance '': the pipeline has 0 stages (devices 0); need at least one");
  EXPECT_EQ(error_of([] { check_halves({1}, 1, 1, ""); }), "--balance 0.5 sums to 0.5 but the model has 1 block");
}

TEST(Balance, ByCostEqualCostsNoExtrasIsAnEvenSplit) {
  // Even counts, the longer runs on the later stages (rule 3).
  const struct {
    int blocks, stages;
    std::vector<int> balance;
  } cases[] = {
      {12, 1, {12}},
      {12, 4, {3, 3, 3, 3}},
      {12, 5, {2, 2, 2, 3, 3}},
      {10, 4, {2, 2, 3, 3}},
      {10, 8, {1, 1, 1, 1, 1, 1, 2, 2}},
      {48, 8, {6, 6, 6, 6, 6, 6, 6, 6}},
      {48, 5, {9, 9, 10, 10, 10}},
      {5, 5, {1, 1, 1, 1, 1}},
  };
  for (const auto& c : cases) {
    // 0.1 is not exact in binary, but every run of k blocks sums to the same double.
    for (double cost : {1.0, 0.1, 3.7e-3}) {
      EXPECT_EQ(balance_by_cost(equal_costs(c.blocks, cost), c.stages, 0.0, 0.0), c.balance)
          << c.blocks << " blocks of " << cost << " over " << c.stages << " stages";
    }
  }
  for (int blocks = 1; blocks <= 12; ++blocks) {
    for (int stages = 1; stages <= blocks; ++stages) {
      const auto balance = balance_by_cost(equal_costs(blocks, 1.0), stages, 0.0, 0.0);
      std::vector<int> reversed(balance.rbegin(), balance.rend());
      EXPECT_EQ(reversed, even_balance(blocks, stages)) << blocks << " over " << stages;
    }
  }
}

TEST(Balance, ByCostTwelveBlocksFourStagesExpensiveHead) {
  // 12 blocks of 1, the last stage 2 more: 14 over 4 stages, so the clock is at least 3.5, and 4
  // is reached. Six partitions have stage costs {4, 4, 3, 3} (rule 1 ties):
  //   4,3,3,2 -> 4 3 3 4   3,4,3,2 -> 3 4 3 4   3,3,4,2 -> 3 3 4 4
  //   4,4,3,1 -> 4 4 3 3   4,3,4,1 -> 4 3 4 3   3,4,4,1 -> 3 4 4 3
  // Rule 2 keeps counts {4, 3, 3, 2} over {4, 4, 3, 1}; rule 3 takes the lightest early stages.
  EXPECT_EQ(balance_by_cost(equal_costs(12, 1.0), 4, 0.0, 2.0), (std::vector<int>{3, 3, 4, 2}));
}

TEST(Balance, ByCostGpt2LikeEmbeddingAndHead) {
  // Embedding half a block on stage 0, head and loss three blocks on the last: 15.5 over 4 stages,
  // clock 4, which leaves the last stage one block and stage 0 three (3.5); 4 + 4 for the rest.
  EXPECT_EQ(balance_by_cost(equal_costs(12, 1.0), 4, 0.5, 3.0), (std::vector<int>{3, 4, 4, 1}));
  // gpt2-xl over 8 stages, embedding 1, head 6: 55 over 8, clock 7; one block of slack, taken
  // from an early middle stage (rule 2 prefers counts 7 7 7 7 7 6 6 1 to 7 7 7 7 7 7 5 1).
  EXPECT_EQ(balance_by_cost(equal_costs(48, 1.0), 8, 1.0, 6.0),
            (std::vector<int>{6, 6, 7, 7, 7, 7, 7, 1}));
  // One stage gets both extras; nothing to choose.
  EXPECT_EQ(balance_by_cost(equal_costs(3, 1.0), 1, 5.0, 7.0), (std::vector<int>{3}));
}

TEST(Balance, ByCostUnequalBlocks) {
  // 1..9 over 3: 8 + 9 = 17 must share the last stage (9 alone leaves 1..8 = 36 for two stages,
  // at least 21), then 1..5 = 15 and 6 + 7 = 13 fit under 17; 1..4 | 5..7 = 18 does not.
  EXPECT_EQ(balance_by_cost({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3, 0.0, 0.0),
            (std::vector<int>{5, 2, 2}));
  EXPECT_EQ(balance_by_cost({9, 8, 7, 6, 5, 4, 3, 2, 1}, 3, 0.0, 0.0),
            (std::vector<int>{2, 2, 5}));
}

TEST(Balance, ByCostTieRuleSecondMostExpensiveStageDecides) {
  // Block 0 costs 5, so every split has a clock of 5: 1,1,3 (5 1 3), 1,2,2 (5 2 2), 1,3,1 (5 3 1).
  // Rule 1 goes on to the second most expensive stage: 2 beats 3. The smallest balance alone would
  // have been 1,1,3.
  EXPECT_EQ(balance_by_cost({5, 1, 1, 1, 1}, 3, 0.0, 0.0), (std::vector<int>{1, 2, 2}));
}

TEST(Balance, ByCostTieRuleCountsDecideWhereCostsTie) {
  // A timer too coarse for the blocks: every cost 0, so every split ties on cost; even counts.
  EXPECT_EQ(balance_by_cost(equal_costs(12, 0.0), 5, 0.0, 0.0),
            (std::vector<int>{2, 2, 2, 3, 3}));
  // Free blocks between two costly ones: 1,3 and 2,2 and 3,1 all cost 1 and 1; even counts win
  // over fewer blocks early.
  EXPECT_EQ(balance_by_cost({1, 0, 0, 1}, 2, 0.0, 0.0), (std::vector<int>{2, 2}));
  // 1,4 to 4,1 all cost 2 and 2; counts 3 and 2 beat 4 and 1, then fewer blocks early.
  EXPECT_EQ(balance_by_cost({2, 0, 0, 0, 2}, 2, 0.0, 0.0), (std::vector<int>{2, 3}));
}

TEST(Balance, ByCostTieRuleFewerBlocksEarlierWhereAllElseTies) {
  // 1 2 1 over 2 stages: 1,2 (1 3) and 2,1 (3 1) tie on costs and counts; stage 0 gets fewer.
  EXPECT_EQ(balance_by_cost({1, 2, 1}, 2, 0.0, 0.0), (std::vector<int>{1, 2}));
  EXPECT_EQ(balance_by_cost(equal_costs(7, 1.0), 2, 0.0, 0.0), (std::vector<int>{3, 4}));
}

// Every way to cut `blocks` into `stages` non-empty runs, in no particular order.
void for_each_partition(int blocks, int stages,
                        const std::function<void(const std::vector<int>&)>& f,
                        std::vector<int>& prefix) {
  if (stages == 1) {
    prefix.push_back(blocks);
    f(prefix);
    prefix.pop_back();
    return;
  }
  for (int first = 1; first <= blocks - (stages - 1); ++first) {
    prefix.push_back(first);
    for_each_partition(blocks - first, stages - 1, f, prefix);
    prefix.pop_back();
  }
}

// The header's rule applied to every partition: the key is compared lexicographically.
struct RuleKey {
  std::vector<double> costs_descending;
  std::vector<int> counts_descending;
  std::vector<int> balance;

  bool operator<(const RuleKey& other) const {
    if (costs_descending != other.costs_descending) {
      return costs_descending < other.costs_descending;
    }
    if (counts_descending != other.counts_descending) {
      return counts_descending < other.counts_descending;
    }
    return balance < other.balance;
  }
};

std::vector<int> brute_force(const std::vector<double>& costs, int stages, double first,
                             double last) {
  std::optional<RuleKey> best;
  std::vector<int> prefix;
  for_each_partition(static_cast<int>(costs.size()), stages, [&](const std::vector<int>& balance) {
    RuleKey key{{}, balance, balance};
    size_t k = 0;
    for (size_t j = 0; j < balance.size(); ++j) {
      double cost = 0.0;
      for (int b = 0; b < balance[j]; ++b) cost += costs[k++];
      if (j == 0) cost += first;
      if (j + 1 == balance.size()) cost += last;
      key.costs_descending.push_back(cost);
    }
    std::sort(key.costs_descending.rbegin(), key.costs_descending.rend());
    std::sort(key.counts_descending.rbegin(), key.counts_descending.rend());
    if (!best || key < *best) best = key;
  }, prefix);
  return best->balance;
}

TEST(Balance, ByCostEqualsTheRuleOverEveryPartition) {
  // Small integer costs, so many ties, from a fixed linear congruential sequence.
  uint32_t state = 12345;
  auto next = [&](uint32_t range) {
    state = state * 1664525u + 1013904223u;
    return (state >> 16) % range;
  };
  for (int trial = 0; trial < 400; ++trial) {
    const int blocks = 1 + static_cast<int>(next(10));
    const int stages = 1 + static_cast<int>(next(static_cast<uint32_t>(blocks)));
    std::vector<double> costs;
    for (int k = 0; k < blocks; ++k) costs.push_back(static_cast<double>(next(4)));
    const double first = static_cast<double>(next(3));
    const double last = static_cast<double>(next(6));
    std::string label = std::to_string(stages) + " stages, extras " + std::to_string(first) +
                        " / " + std::to_string(last) + ", costs";
    for (double c : costs) label += " " + std::to_string(static_cast<int>(c));
    EXPECT_EQ(balance_by_cost(costs, stages, first, last), brute_force(costs, stages, first, last))
        << label;
  }
}

TEST(Balance, ByCostRejectsBadSizesAndCosts) {
  EXPECT_EQ(error_of([] { balance_by_cost(equal_costs(3, 1.0), 4, 0.0, 0.0); }),
            "3 blocks over 4 stages: every stage needs at least one block");
  EXPECT_EQ(error_of([] { balance_by_cost(equal_costs(3, 1.0), 0, 0.0, 0.0); }),
            "3 blocks over 0 stages: need at least one stage");
  EXPECT_EQ(error_of([] { balance_by_cost({}, 1, 0.0, 0.0); }),
            "0 blocks over 1 stage: every stage needs at least one block");
  EXPECT_EQ(error_of([] { balance_by_cost({1, 1, 1, -1, 1}, 2, 0.0, 0.0); }),
            "balance_by_cost: block 3 is -1; costs must be finite and non-negative");
  EXPECT_EQ(error_of([] { balance_by_cost({1, std::nan(""), 1}, 2, 0.0, 0.0); }),
            "balance_by_cost: block 1 is nan; costs must be finite and non-negative");
  EXPECT_EQ(error_of([] {
              balance_by_cost({std::numeric_limits<double>::infinity(), 1}, 2, 0.0, 0.0);
            }),
            "balance_by_cost: block 0 is inf; costs must be finite and non-negative");
  EXPECT_EQ(error_of([] { balance_by_cost({1, 1}, 2, -0.5, 0.0); }),
            "balance_by_cost: first_stage_extra is -0.5; costs must be finite and non-negative");
  EXPECT_EQ(error_of([] { balance_by_cost({1, 1}, 2, 0.0, std::nan("")); }),
            "balance_by_cost: last_stage_extra is nan; costs must be finite and non-negative");
  const double huge = std::numeric_limits<double>::max();
  EXPECT_EQ(error_of([&] { balance_by_cost({huge, huge}, 2, 0.0, 0.0); }),
            "balance_by_cost: the costs sum to inf; rescale them");
}

TEST(Balance, StageOfEachBlock) {
  EXPECT_EQ(stage_of_each_block({2, 1}), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(stage_of_each_block({3, 3, 2}), (std::vector<int>{0, 0, 0, 1, 1, 1, 2, 2}));
  EXPECT_EQ(stage_of_each_block({1}), (std::vector<int>{0}));
  EXPECT_EQ(stage_of_each_block({}), (std::vector<int>{}));
  EXPECT_EQ(error_of([] { stage_of_each_block({2, 0, 1}); }),
            "stage_of_each_block(2,0,1): stage 1 gets 0 blocks");
}

TEST(Balance, FormatRoundTripsThroughParse) {
  EXPECT_EQ(format_balance({3, 3, 2}), "3,3,2");
  EXPECT_EQ(format_balance({12}), "12");
  EXPECT_EQ(format_balance({}), "");
  for (const std::vector<int>& balance :
       {std::vector<int>{3, 3, 2}, std::vector<int>{1}, default_balance(48, 5)}) {
    EXPECT_EQ(parse_balance(format_balance(balance)).blocks_per_stage, balance);
  }
}

// The one check of a stage split: the schedule flags first, then the balance over D x V stages,
// returned in half blocks (blocks doubled; default_balance when none is given).
TEST(Balance, StageHalvesChecksTheScheduleFlagsThenTheBalance) {
  const std::string from = "2 devices x 1 virtual stages";
  EXPECT_EQ(stage_halves({ScheduleKind::kOneFOneB, 1, 4, {}, {}}, 4, 2, from), (std::vector<int>{4, 4}));
  EXPECT_EQ(stage_halves({ScheduleKind::kGpipe, 1, 4, {3, 1}, {}}, 4, 2, from), (std::vector<int>{6, 2}));
  EXPECT_EQ(stage_halves({ScheduleKind::kOneFOneB, 1, 4, {3, 1}, {5, 3}}, 4, 2, from), (std::vector<int>{5, 3}));
  EXPECT_EQ(stage_halves({ScheduleKind::kInterleaved, 2, 4, {}, {}}, 4, 2, "2 devices x 2 virtual stages"),
            (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(error_of([&] { stage_halves({ScheduleKind::kOneFOneB, 1, 0, {}, {}}, 4, 2, from); }), "--n_chunk must be >= 1, got 0");
  EXPECT_EQ(error_of([&] { parse_schedule_kind("zigzag"); }),
            "--pipeline_schedule must be gpipe, 1f1b, interleaved, zb1p or zbv, got 'zigzag'");
  EXPECT_EQ(error_of([&] { stage_halves({ScheduleKind::kOneFOneB, 0, 4, {}, {}}, 4, 2, from); }), "--virtual_stages must be >= 1, got 0");
  EXPECT_EQ(error_of([&] { stage_halves({ScheduleKind::kOneFOneB, 2, 4, {}, {}}, 4, 2, from); }),
            "--virtual_stages 2 needs --pipeline_schedule interleaved (got 1f1b); gpipe, 1f1b and zb1p run one stage per "
            "device");
  EXPECT_EQ(error_of([&] { stage_halves({ScheduleKind::kInterleaved, 1, 3, {}, {}}, 4, 2, from); }),
            "--pipeline_schedule interleaved needs --n_chunk to be a multiple of the 2 devices (Megatron's rule), got 3");
  EXPECT_EQ(error_of([&] { stage_halves({ScheduleKind::kOneFOneB, 1, 4, {2, 1}, {}}, 4, 2, from); }),
            "--balance 2,1 sums to 3 but the model has 4 blocks");
  // A balance in half blocks is named as the flag gave it (1.5,2), not doubled.
  EXPECT_EQ(error_of([&] { stage_halves({ScheduleKind::kOneFOneB, 1, 4, {}, {3, 4}}, 4, 2, from); }),
            "--balance 1.5,2 sums to 3.5 but the model has 4 blocks");
  EXPECT_EQ(error_of([&] { stage_halves({ScheduleKind::kOneFOneB, 1, 4, {}, {8}}, 4, 2, from); }),
            "--balance 4 gives 1 stage but the pipeline has 2 (2 devices x 1 virtual stages)");
  EXPECT_EQ(error_of([&] {
              stage_halves({ScheduleKind::kOneFOneB, 1, 4, {}, {}}, 2, 4, "--pipeline_parallel_size 4 x --virtual_stages 1");
            }),
            "--pipeline_parallel_size 4 x --virtual_stages 1 = 4 stages, but the model has 2 blocks (n_layer 2): " +
                error_of([] { default_balance(2, 4); }));
}

}  // namespace
}  // namespace harness::pipeline
