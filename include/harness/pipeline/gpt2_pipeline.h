// GPT-2 in a pipeline. Its blocks driven by a Pipe: model parallel placement first, then each
// block pinned to its device and the whole run of blocks executed by the Pipe on the devices'
// worker threads. And --balance auto: GPT-2's own pieces timed, then balanced by cost.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "harness/device.h"
#include "harness/model/gpt2.h"
#include "harness/pipeline/pipe.h"

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

// torchgpipe's balance_by_time on GPT-2, on `device` (the model is moved there), at half-block
// grain: times the forward and backward of a block's attention half and MLP half, of the
// embedding and of ln_f + head + loss on micro-batches of `rows` x `tokens` tokens (median of 3
// after a warm-up; GPT-2's blocks are identical, so one stands for all), then balance_by_cost over
// `stages` stages with the embedding on the first and the head on the last. Returns half blocks per
// stage: the head's cost can then be evened out by cutting a block between its halves.
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
