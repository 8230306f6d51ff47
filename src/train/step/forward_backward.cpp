// The whole model's forward and backward (see forward_backward.h).
#include "harness/train/step/forward_backward.h"

#include <torch/torch.h>

#include <stdexcept>

namespace harness::train {

WrappedForwardBackward::WrappedForwardBackward(std::unique_ptr<ForwardBackward> inner, const std::string& what)
    : inner_(std::move(inner)) {
  if (!inner_) throw std::invalid_argument(what + ": no forward-backward given");
}

namespace {

class WholeModel final : public ForwardBackward {
 public:
  explicit WholeModel(model::GPT2LMHeadModel model) : model_(std::move(model)) {}

  at::Tensor run(const data::Batch& batch, const at::Tensor& weight_sum, int64_t k,
                 model::Precision precision) override {
    at::Tensor loss;
    {
      model::AutocastScope autocast(precision, batch.input_ids.device().type());
      loss = model_->loss(batch.input_ids, batch.labels, batch.label_token_weights, weight_sum);
    }
    loss.backward();
    return loss.detach();
  }
  c10::Device input_device() const override { return model_->first_device().torch_device(); }
  c10::Device loss_device() const override { return model_->last_device().torch_device(); }

 private:
  model::GPT2LMHeadModel model_;
};

}  // namespace

std::unique_ptr<ForwardBackward> whole_model(model::GPT2LMHeadModel model) {
  return std::make_unique<WholeModel>(std::move(model));
}

}  // namespace harness::train
