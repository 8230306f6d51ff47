// GPT-2 in a pipeline. Its blocks driven by a Pipe: model parallel placement first, then each
// block pinned to its device and the whole run of blocks executed by the Pipe on the devices'
// worker threads. And the balance of its stages: GPT-2's own pieces costed from their shapes (the
// default) or timed (--balance auto), then cut by cost.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "harness/device.h"
#include "harness/model/gpt2.h"
#include "harness/pipeline/pipe.h"
#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {

// model->parallelize(devices), then WithDevice(block i, block_devices()[i]) for every block in one
// Sequential, a Pipe over it, installed as the model's blocks executor. Pipeline mode:
// split_size = ceil(batch / n_chunk); model parallel on the lanes' threads: split_size >= batch.
// The caller keeps the returned Pipe alive as long as the model runs through it (the executor
// holds only a weak reference and throws once the Pipe is gone); disable_pipeline undoes it.
std::shared_ptr<Pipe> enable_pipeline(model::GPT2LMHeadModel& model, const std::vector<Device>& devices,
                                      int64_t split_size, const PipeOptions& options = {});

// Restores the model's own sequential walk over the blocks (placement is kept).
void disable_pipeline(model::GPT2LMHeadModel& model);

// What GPT-2's pieces cost for one micro-batch, forward and backward: a block's attention half
// (ln_1, attention, c_proj) and MLP half (ln_2, the MLP), the embedding (first stage) and ln_f
// with the tied head and the loss (last stage). Seconds when timed, FLOP-equivalents when
// estimated; only their ratios matter to a balance.
struct Gpt2PieceCosts {
  double embedding = 0.0;
  double attention = 0.0;
  double mlp = 0.0;
  double head = 0.0;
};

// The estimate from the shapes alone, for micro-batches of `rows` x `tokens` (tokens capped at
// n_positions): the same on every rank, machine and run. With C = n_embd, I = the MLP's width,
// V = vocab_size and L = tokens, per token and forward (the backward counted as twice the
// forward's matmuls):
//   attention  8C^2 (c_attn, c_proj) + 2C(L+1) (causal scores and their weighted sum)
//   MLP        4CI (c_fc, c_proj)
//   head       2CV (the tied head's logits)
// plus the memory-bound work (LayerNorms, GELU, dropout, residual adds, the softmax over V, and
// wte's V x C gradient added up once per micro-batch on the first and on the last stage), each
// element counted as kGpt2ElementCost FLOPs: about what a matmul's FLOP/s over an element-wise
// kernel's elements/s is in fp32 on a CPU core and on a GPU alike. Tensor parallelism divides
// every piece's matmuls alike and is left out.
constexpr double kGpt2ElementCost = 64.0;
Gpt2PieceCosts estimate_gpt2_costs(const model::GPT2Config& config, int64_t rows, int64_t tokens);

// Each stage's forward (F), input gradient (B) and weight gradient (W) for a zero-bubble order
// (zbv_schedule's clock), estimated from the shapes as estimate_gpt2_costs, for `halves` (half
// blocks per stage, summing to 2 x n_layer; the embedding on the first stage, the head on the
// last). A linear layer's three matmuls go one to each of F, B and W; the attention scores' two
// forward products and four backward ones to F and B; the memory-bound work a third to F and two
// thirds to B (LayerNorm and bias gradients come with B), but the loss's softmax half and half (its
// fused forward and backward both read the logits); wte's gradient on the first stage to B (the
// lookups' backward), on the last to W (the head's). So each stage's F + B + W is its
// gpt2_stage_costs. In ticks, the largest action of any stage 1000, none below 1. Throws
// std::invalid_argument as estimate_gpt2_costs, or when `halves` has an entry below 1.
std::vector<ActionTicks> estimate_gpt2_stage_ticks(const model::GPT2Config& config, const std::vector<int>& halves,
                                                   int64_t rows, int64_t tokens);

// torchgpipe's balance_by_time measurements on GPT-2, on `device` (the model is moved there):
// the forward and backward of a block's attention half and MLP half, of the embedding and of
// ln_f + head + loss on micro-batches of `rows` x `tokens` tokens (median of 3 after a warm-up;
// GPT-2's blocks are identical, so one stands for all), in seconds.
Gpt2PieceCosts time_gpt2_costs(model::GPT2LMHeadModel& model, const Device& device, int64_t rows, int64_t tokens);

// balance_by_cost over the 2 x n_layer block halves with the embedding on the first stage and the
// head on the last: half blocks per stage, so that the head's cost can be evened out by cutting a
// block between its halves.
std::vector<int> balance_gpt2(const Gpt2PieceCosts& costs, int64_t n_layer, int stages);

// Each stage's cost under `halves` (half blocks per stage, summing to 2 x n_layer).
std::vector<double> gpt2_stage_costs(const Gpt2PieceCosts& costs, const std::vector<int>& halves);

// The pipelines' default split: balance_gpt2 on estimate_gpt2_costs.
std::vector<int> balance_gpt2_by_cost(const model::GPT2Config& config, int stages, int64_t rows, int64_t tokens);

// zbv's default split into 2 x `devices` stages (device d holds stages d and 2 devices - 1 - d): of
// balance_gpt2_by_cost's split, which evens the stages, and the one that evens the devices (each
// device's two stages summed; among those, the stages as even as they can be), the one whose zbv
// order idles least on its estimated ticks (zbv_schedule and simulate on
// estimate_gpt2_stage_ticks) for `micro_batches` of `rows` x `tokens`; the stages' split on a tie.
// The devices' split is searched exhaustively, and only where that means at most
// kZbvSplitsSearched splits (GPT-2 124M: up to 8 devices). In half blocks per stage. Throws
// std::invalid_argument as balance_gpt2_by_cost.
constexpr int64_t kZbvSplitsSearched = 2'000'000;
std::vector<int> balance_gpt2_for_zbv(const model::GPT2Config& config, int devices, int micro_batches, int64_t rows,
                                      int64_t tokens);

// --balance auto: balance_gpt2 on time_gpt2_costs.
std::vector<int> balance_gpt2_by_time(model::GPT2LMHeadModel& model, const Device& device, int stages,
                                      int64_t rows, int64_t tokens);

// Which stage holds GPT-2's parameter `name` (Hugging Face's name, "transformer.h.3.mlp.c_fc.weight")
// when stage s runs block halves [first_unit_of_stage[s], first_unit_of_stage[s + 1]) (unit 2b:
// block b's ln_1 and attn, unit 2b + 1: its ln_2 and mlp): wte and wpe the first stage, ln_f the
// last. The last stage's head uses wte too (tied): stage_holds_gpt2_parameter says so. Throws
// std::invalid_argument naming a parameter that is none of GPT-2's or a block outside the stages.
int gpt2_stage_of_parameter(const std::string& name, const std::vector<int64_t>& first_unit_of_stage);
bool stage_holds_gpt2_parameter(int stage, const std::string& name, const std::vector<int64_t>& first_unit_of_stage);

}  // namespace harness::pipeline
