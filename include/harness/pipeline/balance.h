// How many GPT-2 blocks each pipeline stage gets: run_pipeline's `--balance auto|N,N,...`, the
// default placement of SPEC §4, and torchgpipe's balance-by-time idea on measured block costs.
// Plain data only: the caller times the blocks and builds the stages.
#pragma once

#include <string>
#include <vector>

#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {

// What --balance said: automatic (time the blocks) or explicit blocks per stage.
struct BalanceSpec {
  bool automatic = false;
  std::vector<int> blocks_per_stage;  // empty when automatic, not given, or any item ends in .5
  std::vector<int> halves_per_stage;  // every item in half blocks ("2.5" -> 5); empty likewise
  bool given() const { return automatic || !halves_per_stage.empty(); }  // "" says neither
};

// "auto" -> automatic; "3,3,2" -> {3,3,2}; "" -> neither (the caller uses default_balance).
// Blanks (spaces, tabs) around an item or around "auto" are ignored, so a quoted "3, 3, 2" works;
// inside an item they are not ("3 3"). An item is decimal digits, optionally ending in ".5" (half a
// block: a cut between a block's attention and MLP halves, what --balance auto may print): no
// sign, no "3.0".
// Throws std::invalid_argument naming the flag, the whole value and the first bad item (counted
// from 1):
//   "--balance 3,x,2: item 2 ('x') is not a number of blocks (3, or 2.5 to cut a block between its halves)"
//   "--balance 3,,2: item 2 is empty"          (also "3,3," and a value of blanks only)
//   "--balance 3,0,2: item 2 ('0') is not a positive integer; every stage needs at least one block"
//   "--balance 99999999999: item 1 ('99999999999') is too large (at most 1073741822)"
// Whether the list fits the model and the pipeline is check_balance's job.
BalanceSpec parse_balance(const std::string& text);

// SPEC §4's model-parallel placement: block k goes to stage k / ceil(blocks / stages), i.e.
// contiguous runs of ceil(blocks / stages) blocks and the last stage gets the rest.
//   default_balance(12, 4) == {3, 3, 3, 3}     default_balance(10, 4) == {3, 3, 3, 1}
// Throws std::invalid_argument when stages < 1, blocks < stages, or the runs leave stages empty,
// suggesting even_balance:
//   "12 blocks over 5 stages in runs of ceil(12/5) = 3 leave stage 4 without a block; use --balance
//    to place them, e.g. 3,3,2,2,2"
std::vector<int> default_balance(int blocks, int stages);

// Block counts as equal as they can be, the first blocks % stages stages one block more:
//   even_balance(12, 5) == {3, 3, 2, 2, 2}
// Same size checks as default_balance.
std::vector<int> even_balance(int blocks, int stages);

// Throws std::invalid_argument unless stages >= 1 and balance has `stages` entries, each >= 1,
// summing to `blocks`. `stages_from` says where the stage count comes from and is printed in
// parentheses (left out when empty):
//   "--balance 6,6 gives 2 stages but the pipeline has 4 (devices 2 x virtual stages 2)"
//   "--balance 3,0,2: stage 1 gets 0 blocks; every stage needs at least one"
//   "--balance 3,3,3,3 sums to 12 but the model has 10 blocks"
void check_balance(const std::vector<int>& balance, int blocks, int stages,
                   const std::string& stages_from);
// The same for half blocks per stage (a --balance with N.5 items) against a model of n_layer
// blocks, the values written as the flag took them:
//   "--balance 1.5,2 sums to 3.5 but the model has 4 blocks"
//   "--balance 0.5,0,1: stage 1 gets 0 blocks; every stage needs half a block at least"
void check_halves(const std::vector<int>& halves, int n_layer, int stages, const std::string& stages_from);

// torchgpipe's balance_by_time on measured costs. block_costs[k] is the time of block k (forward +
// backward of one micro-batch); first_stage_extra is added to stage 0 (the embedding),
// last_stage_extra to the last stage (ln_f, the tied head and the loss over the vocabulary); with
// one stage it gets both. A stage's cost is its blocks' costs summed in block order plus its extra.
//
// Returns the contiguous partition into `stages` non-empty runs chosen by, in order:
//   1. stage costs sorted from the most expensive, lexicographically smallest: the most expensive
//      stage (the pipeline's clock) as cheap as possible, then the second most expensive, and on;
//   2. then block counts sorted from the largest, lexicographically smallest: the most even counts
//      (this only decides where costs tie, e.g. blocks that measured 0);
//   3. then the balance itself lexicographically smallest: fewer blocks on earlier stages. Under
//      1F1B stage j holds activations of D - j micro-batches, so that lowers the peak for free.
// Exact dynamic programming over (stages, blocks): both sorted orders are unchanged by adding the
// same stage to two partitions, so the best split of each prefix extends to the best split.
// Costs compare exactly as doubles: integer (or equal) costs tie exactly; for other measured times
// the last bits of a sum can decide between partitions that tie on paper.
//   12 blocks of cost 1 over 4 stages, last_stage_extra 2 -> {3, 3, 4, 2}  (stage costs 3 3 4 4)
//   equal costs, no extras -> even counts, the longer runs last: 12 over 5 -> {2, 2, 2, 3, 3}
// Throws std::invalid_argument on the size errors of default_balance, and naming the block (or the
// extra) when a cost is negative or not finite.
std::vector<int> balance_by_cost(const std::vector<double>& block_costs, int stages,
                                 double first_stage_extra, double last_stage_extra);

// The stage of each block for a balance: {2, 1} -> {0, 0, 1}. Throws std::invalid_argument when
// an entry is below 1.
std::vector<int> stage_of_each_block(const std::vector<int>& balance);

// What a pipeline's flags say about its stages: the schedule flags and the balance, as
// PipelineStepOptions holds them.
struct StageSplitFlags {
  ScheduleKind schedule = ScheduleKind::kOneFOneB;
  int virtual_stages = 1;
  int micro_batches = 1;              // M per full batch (--n_chunk)
  std::vector<int> balance;           // blocks per stage; empty: default_balance
  std::vector<int> balance_halves;    // half blocks per stage; wins over `balance` when given
};

// The one check of a pipeline's stage split, for D = `devices` schedule devices and a model of
// `n_layer` blocks: the schedule flags (check_schedule_flags), then S = D x V stages' balance, in
// half blocks or blocks (check_balance) or by default_balance. Returns the half blocks of each
// stage (block b's attention half is unit 2b, its MLP half 2b + 1). `stages_from` says where S
// comes from, for the errors ("2 devices x 1 virtual stages", "--pipeline_parallel_size 4 x
// --virtual_stages 1"):
//   "--balance 2,1 sums to 3 but the model has 4 blocks"
//   "--pipeline_parallel_size 4 x --virtual_stages 1 = 4 stages, but the model has 2 blocks
//    (n_layer 2): ..."
std::vector<int> stage_halves(const StageSplitFlags& flags, int n_layer, int devices, const std::string& stages_from);

// What the stages line prints after the resolved balance, saying where it came from:
// " (auto, by time)", "" when given by hand, " (default, by cost)" for a pipeline without
// --balance, " (default)" for model parallel's SPEC §4 runs (`pipelined` false).
std::string balance_origin(const BalanceSpec& spec, bool pipelined);

// "3,3,2": the form --balance takes, for printing the resolved balance at start.
std::string format_balance(const std::vector<int>& balance);

// The same for half blocks per stage, as parse_balance reads them back: {5, 3} -> "2.5,1.5",
// {4, 4} -> "2,2".
std::string format_halves(const std::vector<int>& halves);

}  // namespace harness::pipeline
