// One part of every layout's AdamW (step_optimizer.h): how the AdamW state of the parameters this
// rank steps is kept. The optimizer composes it with where those parameters are (the whole model,
// or a pipeline stage's); the norm, the clipping, checkpoints and the --pytest gradients are
// written once, over both.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>
#include <functional>
#include <optional>
#include <stdexcept>
#include <utility>

#include "harness/data_parallel/process_group.h"
#include "harness/train/checkpoint/training_state.h"

namespace harness::train {

// Copies of the tensors a step is about to write, to put back bit for bit: what optimizer
// post-validation (step_optimizer.h) keeps to undo a step taken before the global norm arrived.
class KeptTensors {
 public:
  void keep(std::vector<at::Tensor> tensors);  // copies them (the originals are written later)
  void restore();                              // each original back to its copy, in place
  void clear();                                // the copies let go

 private:
  std::vector<at::Tensor> originals_, copies_;
};

// AdamW's state of the parameters this rank steps ("held", in the model's order): each moment
// whole (step_optimizer.cpp), or ZeRO's chunks over the data-parallel group (zero/moments.h:
// of the gradient buckets under ZeRO-1/2, of the units under ZeRO-3). Calls marked collective are
// made by every rank of the data-parallel group in the same order (they hold the same parameters).
class HeldAdamW {
 public:
  virtual ~HeldAdamW() = default;
  virtual void zero_grad() = 0;
  // The gradients the step reads, each with the held parameter it belongs to: whole gradients,
  // or this rank's pieces of the averaged buckets (the group's ranks' pieces together make the
  // averaged gradient: shard_group() says which group).
  virtual void for_each_gradient(const std::function<void(size_t, const at::Tensor&)>& visit) const = 0;
  virtual const data_parallel::DistContext* shard_group() const { return nullptr; }
  virtual void scale_gradients(double factor) = 0;
  virtual void step() = 0;
  virtual void set_learning_rate(double learning_rate) = 0;
  virtual double learning_rate() const = 0;
  // Optimizer post-validation: before a step taken ahead of the global gradient norm,
  // keep_for_undo() copies everything step() will write (weights, moments, step counts);
  // undo_step() puts it back bit for bit, as if the step had not been taken; forget_undo() lets
  // the copies go. No collective: every rank of the group undoes alike, and a step taken again
  // is collective as step() is.
  virtual void keep_for_undo() = 0;
  virtual void undo_step() = 0;
  virtual void forget_undo() = 0;
  virtual int64_t state_bytes() const = 0;
  // The steps held parameter i has taken, if it has state (no collective).
  virtual std::optional<int64_t> steps_of(size_t i) const = 0;
  // Held parameter i's two moments, shaped like it here (collective when sharded).
  virtual std::pair<at::Tensor, at::Tensor> moments(size_t i) = 0;
  // Held parameter i's averaged gradient (undefined if it has none; collective when sharded).
  virtual at::Tensor gradient(size_t i) = 0;
  // What moments() and gradient() gathered is let go (after a walk over the parameters).
  virtual void forget_gathered() {}
  // The state of held parameters by name, shaped like them here; the others start without.
  virtual void load(const OptimizerState& state) = 0;

  // Where the weights are kept too (ZeRO-3's chunks), instead of in the model's parameters:
  // held parameter i's weights shaped like it here (collective), its weights set from `local`
  // (this rank's part of it, shaped like it), and every weight brought into the parameters for
  // an evaluation or the saved model, until zero_grad().
  virtual bool keeps_weights() const { return false; }
  virtual at::Tensor weight(size_t) { throw std::logic_error("HeldAdamW: the weights are the parameters"); }
  virtual void load_weight(size_t, const at::Tensor&) { throw std::logic_error("HeldAdamW: the weights are the parameters"); }
  virtual void gather_weights() {}
};

}  // namespace harness::train
