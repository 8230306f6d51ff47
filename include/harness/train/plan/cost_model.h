// A step's time predicted from a plan, a model's shapes and a machine file, without running
// anything (build/plan, docs/planning.md):
//
//   compute         each stage's forward and backward from the FLOPs of its pieces
//                   (pipeline::estimate_gpt2_costs: matmuls by shape, attention, the element-wise
//                   work counted in FLOP-equivalents) over the machine's matmul rate in the run's
//                   precision, 1/T of it on each tensor-parallel rank; activation checkpointing
//                   runs the forward again in the backward
//   pipeline        the executor's own schedule (train::gpt2_training_schedule) walked on a clock
//                   whose actions take their stage's predicted time (pipeline::simulate): the
//                   bubble comes from the schedule itself, 1F1B, interleaved, zb1p or zbv alike
//   communication   each collective's algorithm on the link its group crosses (the rank order
//                   decides which groups stay inside a host): tensor parallelism's all-reduces
//                   (sequence parallelism's all-gathers and reduce-scatters) exposed, context
//                   parallelism's ring behind the attention it feeds, the stages' sends, and the
//                   gradients' all-reduce (ZeRO: reduce-scatter, then the weights' all-gather;
//                   ZeRO-3 the units' all-gathers) behind the backward but its last bucket
//   optimizer       AdamW's pass over the state a rank steps, at the memory's rate
//   memory          the memory plan (plan/memory_plan.h), against the device's memory
//
// A first model: its accuracy against measured runs is what scripts would establish; the figures
// it uses come from the machine file, each with its source.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "harness/model/config.h"
#include "harness/train/plan/plan.h"

namespace harness::train {

// One kind of link: what one device can send over it.
struct Link {
  double bytes_per_second = 0.0;  // per device, one direction
  double latency_seconds = 0.0;   // per message
};

// A machine file (machines/*.json): per device, and how the devices are connected.
struct Machine {
  std::string name;
  int devices_per_host = 1;
  double fp32_flops = 0.0;           // peak matmul FLOP/s in fp32 (TF32 where that is the default)
  double bf16_flops = 0.0;           // peak matmul FLOP/s in bf16
  double matmul_efficiency = 1.0;    // of the peak, what GPT-2's matmuls reach
  double memory_bytes_per_second = 0.0;  // the memory's bandwidth (element-wise work, AdamW)
  int64_t memory_bytes = 0;          // per device
  Link inside_host;
  Link between_hosts;
  nlohmann::json sources = nlohmann::json::object();  // each figure's source, by field name
};

// Strict: every field present with its type, each figure > 0 and its source given; errors name
// `origin` and the field ("machines/x.json: field 'bf16_flops' must be a number > 0").
Machine machine_from_json(const nlohmann::json& json, const std::string& origin);
nlohmann::json machine_to_json(const Machine& machine);
Machine read_machine(const std::string& path);

// The collectives the layouts use, by algorithm.
enum class Collective { kAllReduce, kAllGather, kReduceScatter, kSendRecv };

// Bytes one rank sends for a collective over `payload_bytes` (the whole tensor's) among `ranks`:
// ring all-reduce 2 (n - 1) / n of it, all-gather and reduce-scatter (n - 1) / n, a send the whole;
// 0 for one rank.
double collective_bytes(Collective collective, double payload_bytes, int ranks);
// Its time on `link`: the bytes over the bandwidth, plus one latency a ring step (2 (n - 1) for
// an all-reduce, n - 1 for the others, 1 for a send).
double collective_seconds(Collective collective, double payload_bytes, int ranks, const Link& link);

// Training FLOPs of one transformer block for `tokens` tokens of sequences of `sequence_length`
// (forward and backward, the backward twice the forward): 6 x its 12 C^2 (with I = 4C; 8C^2 + 4CI
// in general) parameters' multiply-adds a token, plus the attention's scores and weighted sum,
// 3 x 2 C L a token under the causal mask.
double block_training_flops(const model::GPT2Config& config, double tokens, int64_t sequence_length);
// The whole model's: the blocks, and the tied head's logits (6 C V a token).
double model_training_flops(const model::GPT2Config& config, double tokens, int64_t sequence_length);

// What a prediction is for: the model, the work and the machine.
struct PlanQuestion {
  model::GPT2Config config;
  std::string model_name;
  int64_t batch_size = 0;          // global
  int64_t sequence_length = 128;   // --model_max_length
  bool bf16 = false;               // --precision bf16
  int nproc_per_node = 0;          // 0: the machine's devices_per_host
  Machine machine;
};

struct StepPrediction {
  Plan plan;
  double step_seconds = 0.0;
  double compute_seconds = 0.0;       // the busiest device's forward and backward
  double exposed_comm_seconds = 0.0;  // what no computation hides
  double bubble_seconds = 0.0;        // the pipeline's idle time on that device
  double optimizer_seconds = 0.0;
  double tokens_per_second = 0.0;
  double mfu = 0.0;                   // the model's FLOPs over the step, of every device's peak
  int64_t memory_bytes_per_device = 0;  // the memory plan's largest
  bool fits = true;
  std::string why_not;                // when it does not fit
};

// One layout's step. Throws std::invalid_argument naming the flag where the plan cannot run the
// model at all (Plan::validate's rules, heads T does not divide, more stages than half blocks,
// rows the micro-batches do not divide).
StepPrediction predict_step(const PlanQuestion& question, const Plan& plan);

// Every layout of `world_size` devices that can run the model, ranked fastest first (those that
// do not fit after those that do): D x C x T x P over the divisors, sequence parallelism with
// T > 1, ZeRO 0 to 3, and with P > 1 the schedules 1f1b, interleaved (2 virtual stages) and zb1p
// at P, 2P and 4P micro-batches, with activation checkpointing off and on.
std::vector<StepPrediction> rank_layouts(const PlanQuestion& question, int world_size);

// build/plan --json's object (SPEC §7.4).
nlohmann::json predictions_to_json(const PlanQuestion& question, int world_size,
                                   const std::vector<StepPrediction>& predictions);

}  // namespace harness::train
