// What each rank of a layout holds in memory: its parameters, gradients and AdamW state (exact, from
// the model's shapes and the ZeRO stage) and an estimate of its activations, computed from the
// config alone (no model is built); the memory a rank may use on this machine; and the refusal of a
// run whose model state alone cannot fit. Plain data in, a plan out, and the text the programs print.
//
// Model state per rank, everything in fp32 (--precision bf16 changes only the activations: the
// master weights, gradients and AdamW moments stay fp32), for the Ψ parameters the rank holds (its
// slices with tensor parallelism, its stages' parameters with pipeline stages) over D data-parallel
// ranks, shards rounded up:
//
//     --zero_stage   weights          gradients                    AdamW (exp_avg, exp_avg_sq)
//     0              4Ψ               4Ψ                           8Ψ
//     1              4Ψ               4Ψ                           8Ψ / D
//     2              4Ψ               4Ψ / D + one bucket          8Ψ / D
//     3              4Ψ / D + u       4Ψ / D + u                   8Ψ / D
//
// where one bucket is --bucket_cap_mb (at most 4Ψ) and u = (zero_prefetch + 1) x 4 x the largest
// unit's parameters (a block, or the embeddings wte + wpe, gathered whole): the units prefetched
// plus the one being computed (inside pipeline stages u = 4Ψ: every unit of the stages is
// gathered for the whole step, and its gradients kept until its last micro-batch's backward).
// The same accounting as DeepSpeed's
// estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs, with fp32 weights
// and gradients instead of fp16 ones. A pipeline's first stage holds wte and wpe, its last stage
// ln_f and its own copy of the tied wte (both step it).
//
// Activations are an ESTIMATE from the shapes, not a measurement: per token of a micro-batch of r
// rows x t tokens (b = 4 bytes in fp32, 2 under bf16 autocast for the matmuls' inputs and outputs;
// layer norm inputs stay fp32; C = n_embd, I = the MLP's inner size, a = n_head, T = tensor ranks):
//
//     attention half   4C (ln_1 in) + bC (ln_1 out) + b 3C/T (q, k, v) + b C/T (heads merged)
//                      + with attention dropout: (2b + 1) (a/T) t (probabilities, dropped, mask)
//                        without: 4 (a/T) (the fused kernel's log-sum-exp)
//                      + with residual dropout: C (mask)
//     MLP half         4C (ln_2 in) + bC (ln_2 out) + 2b I/T (c_fc out, gelu out) + C (mask)
//     embeddings       4C (+ C, the mask, with embedding dropout)          first stage
//     head and loss    4C + bC (ln_f) + 8V/T (logits and their softmax)   last stage
//
// With sequence parallelism each rank holds 1/T of every term but the inputs the column-parallel
// layers gather whole (ln_1's, ln_2's and ln_f's out, bC each) and the attention terms, which are
// per head already: 4C/T (ln_1 in) + bC + b 3C/T + b C/T + attention + C/T; 4C/T + bC + 2b I/T + C/T;
// (4C + C)/T; 4C/T + bC + 8V/T.
//
// times r x t, summed over a stage's units. Without a pipeline a rank holds one micro-batch of all
// its rows (--batch_size / D). In a pipeline each device's schedule is walked in its own order:
// a forward adds its stage's activations for that micro-batch (only the stage's input, 4C a token,
// when the forward is checkpointed), its backward frees them, and a checkpointed backward
// recomputes the whole stage while it runs; under a zero-bubble schedule the activations stay,
// counted whole, from the B until the W. The peak of that walk is the estimate. Transient
// buffers of the backward, the allocator's slack and the framework's own memory are not counted,
// nor the copy of a stage's weights and AdamW state that post-validation keeps during the step
// (zero-bubble schedules, stage_adamw's post_validate), when the activations are already freed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "harness/device.h"
#include "harness/model/config.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/train/plan/plan.h"

namespace harness::train {

struct PipelineStepOptions;

// The layout, model and batch a plan is made for.
struct MemoryPlanInput {
  std::string program = "run_data_parallel";  // whose plan: names the ranks ("rank" or the devices)
  std::string model_name;                     // --model or --model_path, for the header
  model::GPT2Config config;
  // The run's sizes, ZeRO stage and bucket (D x C ranks share each slice's state, ZeRO shards over
  // them; `tokens` is a rank's, 1/C of a sequence). Pipeline stages come as resolved below.
  Plan plan;
  // Pipeline: `pipeline_devices` stage processes (run_data_parallel's P) or devices (run_pipeline),
  // each running virtual_stages stages (stage s on device s % devices).
  bool pipeline = false;
  int pipeline_devices = 1;
  int virtual_stages = 1;
  std::vector<int> balance_halves;   // half blocks per stage; empty: default_balance's blocks
  std::string balance_note;          // said in the header ("--balance auto: the default balance")
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::kOneFOneB;
  int micro_batches = 1;             // M (--n_chunk)
  pipeline::ActivationCheckpointing checkpointing = pipeline::ActivationCheckpointing::kNever;
  int64_t rows_per_replica = 1;  // --batch_size / D
  int64_t tokens = 128;          // --model_max_length
  bool bf16 = false;             // --precision bf16
  // run_pipeline's devices by name ("cuda:0"), one per pipeline device; empty: ranks by number.
  std::vector<std::string> device_names;
};

// One kind of rank: those that hold the same.
struct RankMemory {
  std::vector<int> ranks;  // world ranks, or pipeline device indices for run_pipeline
  std::string who;         // "ranks 0-3", "cuda:1"
  std::string holds;       // "whole model", "stage 0: block halves 0-5, wte, wpe"
  int64_t parameters = 0;  // Ψ: parameters this rank holds
  int64_t weight_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t activation_bytes = 0;  // the estimate of the header
  // Pipelines: this device's share of a micro-batch's forward and backward work, its stages' costs
  // by pipeline::estimate_gpt2_costs over all stages' (0 to 1); -1 without stages.
  double work_share = -1.0;
  int64_t model_state_bytes() const { return weight_bytes + gradient_bytes + optimizer_bytes; }
  int64_t total_bytes() const { return model_state_bytes() + activation_bytes; }
};

struct MemoryPlan {
  MemoryPlanInput input;
  int64_t model_parameters = 0;  // the unsplit model's, tied head once
  std::vector<RankMemory> kinds;  // in rank order, one entry per distinct kind
  // The kind with the most model state (the first of equals).
  const RankMemory& largest_model_state() const;
};

// Parameters of GPT-2 with `config`, counting the tied head once (gpt2: 124,439,808), from the
// shapes alone.
int64_t gpt2_parameter_count(const model::GPT2Config& config);

// Throws std::invalid_argument naming the value on sizes below 1, a tensor-parallel size the
// model does not divide, or a balance that does not fit the model and the stages.
MemoryPlan plan_memory(const MemoryPlanInput& input);

// A pipeline's part of `in`: `devices` schedule devices running `stages` (their schedule, V, M,
// activation checkpointing and balance; `balance_by_time`: --balance auto, planned with the
// default balance and said so).
void plan_stages(MemoryPlanInput& in, int devices, const PipelineStepOptions& stages, bool balance_by_time);

// What one rank may use, and how that was found.
struct AvailableMemory {
  int64_t bytes_per_rank = 0;
  std::string how;  // "MemAvailable 16000000000 bytes / 2 ranks on this host", ...
};

// The memory each of the ranks on `devices` (one entry per rank or pipeline device of this host)
// may use: on GPUs the smallest free memory of theirs (cudaMemGetInfo; `release_gpu_context`
// drops the context the query made, for a launcher that trains nothing itself); on CPUs
// /proc/meminfo's MemAvailable divided among them. Test hook: HARNESS_TEST_AVAILABLE_MEMORY_BYTES
// in the environment replaces the figure, so that a refusal can be tested without a huge model.
// `noun` names them in the text ("rank", "device").
AvailableMemory available_memory(const std::vector<Device>& devices, bool release_gpu_context = false,
                                 const std::string& noun = "rank");

// "1234567 bytes (1.18 MiB)"
std::string bytes_text(int64_t bytes);

// The printed plan (--memory_plan): a header, one row per kind of rank, the memory available per
// rank and whether the model state fits.
std::string format_memory_plan(const MemoryPlan& plan, const AvailableMemory& available);
// One line of it for the start of a run (without the program's prefix).
std::string memory_plan_line(const MemoryPlan& plan, const AvailableMemory& available);

// Refuses a run whose model state alone does not fit: throws std::invalid_argument naming the
// bytes needed (and on which ranks), the bytes available and how they were measured, and the
// smallest --zero_stage that would fit. `stage_unavailable(s)` says why this build cannot run
// stage s for this layout (empty when it can), so the message says so instead of suggesting it.
void check_model_state_fits(const MemoryPlan& plan, const AvailableMemory& available,
                            const std::function<std::string(int)>& stage_unavailable);

// The devices of run_data_parallel's ranks on this host for --device (auto: GPUs 0 .. ranks - 1
// when there are GPUs), one entry per rank, as its workers choose them.
std::vector<Device> data_parallel_devices(DeviceChoice choice, int ranks_on_host);

}  // namespace harness::train
