// How a training step's optimizer steps, and what of its state a checkpoint holds: one part of a
// training step, chosen once by the layout. AdamW on each rank's parameters (replicated_adamw: the
// whole model, or this rank's slices of a model split over a tensor-parallel group, its state
// gathered unsplit), or ZeRO-1's AdamW, sharded over the data-parallel ranks (sharded_adamw).
// Either way checkpoints hold the unsplit, unsharded state, so a run resumes in any layout.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "harness/model/gpt2.h"
#include "harness/train/training_state.h"

namespace harness::data_parallel {
class BucketedAllReduce;
}

namespace harness::train {

class StepOptimizer {
 public:
  virtual ~StepOptimizer() = default;
  virtual void zero_grad() = 0;
  // After the gradients are synchronised.
  virtual void step() = 0;
  // The state under Hugging Face names, unsplit and unsharded (collective where collective_state()).
  virtual OptimizerState state() = 0;
  // Whether state(), save_state() or the model's full_state() is a collective every rank calls.
  virtual bool collective_state() const = 0;
  // A checkpoint's weights (model.safetensors at weights_path) and AdamW state (optimizer_path),
  // written where `write`; each unsplit tensor is streamed into its file as it is gathered.
  virtual void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) = 0;
  // Unsplit weights and state in (each rank keeps its part). Errors name the tensor.
  virtual void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) = 0;
  // The last backward's gradients, averaged over the data-parallel ranks, unsplit, on the CPU
  // (collective where the state is).
  virtual model::NamedTensors unsplit_gradients() = 0;
  // Bytes of optimizer state this rank holds.
  virtual int64_t state_bytes() const = 0;
};

// AdamW (optim::FusedAdamW) on `model`'s parameters as they are here.
std::unique_ptr<StepOptimizer> replicated_adamw(model::GPT2LMHeadModel model, double learning_rate);

// ZeRO-1: `gradients` (a BucketedAllReduce in kReduceScatter mode, the step's synchronizer) is
// attached to `model` here; each rank keeps AdamW's moments for its chunks (data_parallel/zero.h).
std::unique_ptr<StepOptimizer> sharded_adamw(model::GPT2LMHeadModel model, double learning_rate,
                                             data_parallel::BucketedAllReduce& gradients);

}  // namespace harness::train
