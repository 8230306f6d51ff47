// How a training step's optimizer steps, and what of its state a checkpoint holds: one part of a
// training step, chosen once by the layout. AdamW on each rank's parameters (replicated_adamw: the
// whole model, or this rank's slices of a model split over a tensor-parallel group, its state
// gathered unsplit), or ZeRO-1's AdamW, sharded over the data-parallel ranks (sharded_adamw).
// Either way checkpoints hold the unsplit, unsharded state, so a run resumes in any layout.
// Each step measures the global gradient norm as one device would (and clips by it when asked),
// whatever the layout; the learning rate can change between steps (a schedule).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/model/gpt2.h"
#include "harness/train/checkpoint/training_state.h"
#include "harness/train/step/held_adamw.h"

namespace harness::train {

// AdamW's settings and the clipping, fixed for the run. A bare learning rate means the rest at
// their defaults (torch's AdamW: weight decay 0.01; no clipping).
struct OptimizerSettings {
  OptimizerSettings(double learning_rate = 1e-4) : learning_rate(learning_rate) {}  // NOLINT: implicit
  double learning_rate;         // the rate until set_learning_rate changes it
  double weight_decay = 0.01;   // AdamW's decoupled decay
  double max_grad_norm = 0.0;   // clip by the global gradient norm (torch's clip_grad_norm_); 0: off
  // Where the layout allows it (pipeline stages that are processes, under a zero-bubble
  // schedule): step before the global norm is known, undoing the step where it must
  // (PipelineStageParameters::post_validate). Off: every step waits for the norm.
  bool post_validate = true;
};

class StepOptimizer {
 public:
  virtual ~StepOptimizer() = default;
  virtual void zero_grad() = 0;
  // After the gradients are synchronised: measures the global norm of the whole model's gradient
  // (last_grad_norm), scales every gradient by max_grad_norm / (norm + 1e-6) where that is below 1
  // (clip_grad_norm_'s rule) when clipping, then AdamW's step. Collective where the gradient is
  // split (tensor parallelism) or sharded (ZeRO).
  virtual void step() = 0;
  // The rate of the following steps (every parameter).
  virtual void set_learning_rate(double learning_rate) = 0;
  virtual double learning_rate() const = 0;
  // The global gradient norm the last step() measured, before clipping (0 before any step).
  double last_grad_norm() const { return last_grad_norm_; }
  // Optimizer post-validation's tally (PipelineStageParameters::post_validate): the steps taken
  // before the global norm arrived, and of those the ones undone (then clipped, or skipped).
  struct PostValidation {
    int64_t early = 0;
    int64_t undone = 0;
  };
  PostValidation post_validation() const { return post_validation_; }
  // Called in each step() once the global norm is known, every collective of the step done, and
  // before anything changes (elastic training's commit vote, data_parallel/elastic_rendezvous.h).
  // It may throw, and the step then changes nothing. Empty: none.
  void set_before_update(std::function<void()> hook) { before_update_ = std::move(hook); }
  // The state under Hugging Face names, unsplit and unsharded (collective where collective_state()).
  virtual OptimizerState state() = 0;
  // Whether state(), save_state() or the model's full_state() is a collective every rank calls.
  virtual bool collective_state() const = 0;
  // A checkpoint's weights (model.safetensors at weights_path) and AdamW state (optimizer_path),
  // written where `write`; each unsplit tensor is streamed into its file as it is gathered.
  virtual void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) = 0;
  // Unsplit weights and state in (each rank keeps its part). Errors name the tensor.
  virtual void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) = 0;
  // The AdamW state of the parameters this rank steps, by name and shaped as here (copies), with
  // no collective; and its loading into a step composed again for the same stages over other
  // groups (elastic training, whose weights stay in the model's parameters meanwhile). Where the
  // state is sharded (ZeRO) it is not this rank's alone: std::logic_error.
  virtual OptimizerState local_state() = 0;
  virtual void load_local_state(const OptimizerState& state) = 0;
  // The last backward's gradients, averaged over the data-parallel ranks, unsplit, on the CPU
  // (collective where the state is).
  virtual model::NamedTensors unsplit_gradients() = 0;
  // Bytes of optimizer state this rank holds.
  virtual int64_t state_bytes() const = 0;
  // Brings every weight of the model on this rank up to date where the layout keeps some current
  // elsewhere only (pipeline stages that are processes: from the stage that steps it). A
  // collective there; nothing to do otherwise.
  virtual void gather_weights() {}
  // The unsplit weights as Hugging Face's model.safetensors at `path` (written where `write`),
  // streamed one piece at a time without gathering the whole model, where the layout can (ZeRO-3,
  // pipeline stages that are processes);
  // false: it cannot, and the caller saves the gathered model. A collective where it streams.
  virtual bool stream_weights(const std::string& path, bool write) { return false; }

 protected:
  double last_grad_norm_ = 0.0;
  PostValidation post_validation_;
  std::function<void()> before_update_;
};

// The factor clip_grad_norm_ scales gradients by: max_norm / (norm + 1e-6), capped at 1 (1 when
// max_norm is 0, clipping off).
double clip_coefficient(double norm, double max_norm);

// AdamW (optim::FusedAdamW) on `model`'s parameters as they are here. Split over a tensor-parallel
// group, the norm sums the split parameters' squares over the group and counts the replicated
// ones once; spread over devices (model parallel, the in-process pipeline), it sums over them.
std::unique_ptr<StepOptimizer> replicated_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings);

// How the AdamW state of the parameters a rank steps is kept (held_adamw.h): whole, or as ZeRO's
// chunks (zero/moments.h). Called once with the parameters the rank steps.
using HeldAdamWFactory = std::function<std::unique_ptr<HeldAdamW>(const NamedParameters&)>;

// AdamW on the whole of `model` here, its state kept by `state` (ZeRO's, zero/zero.h). The norm
// and checkpoints as replicated_adamw's, over whatever `state` holds.
std::unique_ptr<StepOptimizer> whole_model_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings,
                                                 HeldAdamWFactory state);

// Pipeline stages that are processes: what this rank's stages hold and who owns each parameter.
struct PipelineStageParameters {
  std::vector<std::string> held;      // the parameters this rank's stages use (Hugging Face names)
  std::map<std::string, int> owner;   // every parameter's owning pipeline rank (wte: the first stage's)
  data_parallel::DistContext pipeline;  // the pipeline group this rank is rank `owner` of
  // Optimizer post-validation (Qi et al., ICLR 2024): the stage steps AdamW as soon as its own
  // gradients are done, while the global norm (the pipeline group's sum of squares) is on its
  // way, keeping a copy of what the step writes; when the norm arrives, a step that clipping or a
  // non-finite norm concerns is undone bit for bit and taken again clipped, or skipped. Results
  // are the synchronous step's bit for bit; the copy costs the held weights and moments once more
  // while the step runs.
  bool post_validate = false;
};

// AdamW on the parameters this rank's stages hold (wte on the first and the last stage's ranks,
// whose gradients the embedding group has summed, so both copies take the same step). The other
// stages' parameters keep no storage here while training (an empty tensor each); gather_weights()
// brings them from their stages for an evaluation or a checkpoint, and the next step lets them go
// again. The norm sums each owned gradient's squares over the stages (wte's once); checkpoints and
// --pytest's gradients gather every stage's part. `state`: how the held parameters' AdamW state is
// kept (empty: whole; ZeRO's chunks over the stage's replicas, zero/zero.h).
std::unique_ptr<StepOptimizer> stage_adamw(model::GPT2LMHeadModel model, const OptimizerSettings& settings,
                                           PipelineStageParameters stage, HeldAdamWFactory state = {});

}  // namespace harness::train
