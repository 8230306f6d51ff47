// The split backward's store and its per-thread scope (see weight_grad_store.h).
#include "harness/model/weight_grad_store.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "shape_text.h"

namespace harness::model {
namespace {

thread_local WeightGradStore* current_store = nullptr;

}  // namespace

void WeightGradStore::put(torch::Tensor parameter, std::function<torch::Tensor()> weight_grad) {
  if (!parameter.defined() || !parameter.is_leaf() || !parameter.requires_grad()) {
    throw std::invalid_argument(
        "WeightGradStore::put: the parameter" +
        (parameter.defined() ? " of shape " + shape_str(parameter.sizes()) : std::string(" (undefined)")) +
        " is not a leaf that requires grad: a deferred gradient can only be accumulated into a leaf's .grad");
  }
  if (!weight_grad) {
    throw std::invalid_argument("WeightGradStore::put: no product given for the parameter of shape " +
                                shape_str(parameter.sizes()));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  products_.emplace_back(std::move(parameter), std::move(weight_grad));
}

void WeightGradStore::flush() {
  decltype(products_) products;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    products.swap(products_);
  }
  torch::NoGradGuard no_grad;
  for (auto& [parameter, weight_grad] : products) {
    torch::Tensor grad = weight_grad();
    if (!grad.defined() || grad.sizes() != parameter.sizes() || grad.device() != parameter.device()) {
      throw std::invalid_argument(
          "WeightGradStore::flush: a deferred gradient " +
          (grad.defined() ? "of shape " + shape_str(grad.sizes()) + " on " + grad.device().str() : "(undefined)") +
          " for a parameter of shape " + shape_str(parameter.sizes()) + " on " + parameter.device().str());
    }
    // The engine casts each gradient to its input's dtype before AccumulateGrad sees it (under
    // autocast: the bf16 product back to the fp32 weight's, as the cast's backward does).
    grad = grad.to(parameter.scalar_type());
    // Accumulated by autograd's own AccumulateGrad node, reached through an alias of the leaf (its
    // backward passes the gradient on untouched): the same rule as the joint backward's, and the
    // hooks on the accumulator (bucketed gradient averaging, ZeRO's buckets) see it as they would.
    torch::Tensor root;
    {
      torch::AutoGradMode graph(true);
      root = parameter.alias();
    }
    torch::autograd::backward({root}, {grad});
  }
}

size_t WeightGradStore::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return products_.size();
}

bool WeightGradStore::empty() const { return size() == 0; }

DeferWeightGradients::DeferWeightGradients(WeightGradStore* store) : previous_(current_store) {
  current_store = store;
}

DeferWeightGradients::~DeferWeightGradients() { current_store = previous_; }

WeightGradStore* deferred_weight_gradients() { return current_store; }

}  // namespace harness::model
