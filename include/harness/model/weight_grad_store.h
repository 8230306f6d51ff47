// The split backward of zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline
// Parallelism", ICLR 2024): a stage's backward becomes B, the gradients of its input (which the
// previous stage waits for), and W, the linear layers' weight gradients (which nobody waits for,
// so a schedule runs them later, in what would otherwise be bubbles).
//
// Under a DeferWeightGradients scope, the forwards of GPT-2's linear layers (every Conv1D, in any
// parallel style, and the tied head's product, vocabulary_logits) leave their weight out of the
// autograd graph and hook their product instead: the backward that follows is B, and on reaching
// each product it puts that layer's weight-gradient product, still to run, into the store.
// store.flush() is W. What is deferred: the weight gradients of those products alone. The
// LayerNorms, every bias and the embeddings (wte's lookup, wpe) take their gradients in B as
// before. The deferred products are the ops autograd's own derivatives run
// (casts under autocast included), so B then W gives the joint backward's gradients bit for bit
// where each parameter's gradient comes from one side only. A leaf with a gradient from both
// sides in one backward (wte when the model holds the embedding and the head together) gets the
// same terms summed in another order: equal for one backward, within rounding once several
// accumulate. A pipeline's last stage projects onto a copy of wte, a leaf of its own, so there
// each side has its own leaf.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace harness::model {

// One stage's, one micro-batch's deferred weight-gradient products, in the order the backward
// reached them.
class WeightGradStore {
 public:
  // Keeps one product: `weight_grad()` returns the gradient for `parameter`, a leaf that requires
  // grad (else std::invalid_argument). Autograd calls this during backward, from whichever thread
  // runs the node (its device threads on GPUs), so puts are serialised by a mutex.
  void put(torch::Tensor parameter, std::function<torch::Tensor()> weight_grad);
  // W: runs every product in the order put, under a no-grad guard, and accumulates each into its
  // parameter's .grad through autograd's own AccumulateGrad node (cast to the parameter's dtype
  // first, as the engine casts a gradient to its input's), so that the hooks on a parameter's
  // accumulator (bucketed gradient averaging, ZeRO-1/2's buckets) fire as in a joint backward;
  // then empties the store. A product whose shape or device is not its parameter's is a
  // std::invalid_argument naming both. Puts that arrive during a flush wait for the next one.
  void flush();
  size_t size() const;
  bool empty() const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<torch::Tensor, std::function<torch::Tensor()>>> products_;
};

// While alive on the calling thread, the forwards of GPT-2's linear layers that run under grad
// mode, on a leaf weight that requires grad and an input that requires grad, record their weight
// gradient into `store` during backward instead of computing it there; nullptr turns deferral
// off. The store is read at forward time and captured into the graph, so the backward may run on
// any thread; it must outlive that backward and hold its products until flushed. Scopes nest: the
// previous store comes back on destruction. Like autocast, this is per thread: each worker thread
// that runs a stage's forward opens its own scope.
class DeferWeightGradients {
 public:
  explicit DeferWeightGradients(WeightGradStore* store);
  ~DeferWeightGradients();
  DeferWeightGradients(const DeferWeightGradients&) = delete;
  DeferWeightGradients& operator=(const DeferWeightGradients&) = delete;

 private:
  WeightGradStore* previous_;
};

// This thread's store (the innermost DeferWeightGradients'), or nullptr.
WeightGradStore* deferred_weight_gradients();

}  // namespace harness::model
