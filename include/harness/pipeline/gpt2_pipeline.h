// GPT-2's blocks driven by a Pipe: model parallel placement first, then each block pinned to its
// device and the whole run of blocks executed by the Pipe on the devices' worker threads.
#pragma once

#include <cstdint>
#include <memory>
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

}  // namespace harness::pipeline
