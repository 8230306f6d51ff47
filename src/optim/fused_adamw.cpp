// AdamW through ATen's fused kernel (see fused_adamw.h).
#include "harness/optim/fused_adamw.h"

#include <ATen/ops/_fused_adamw.h>
#include <torch/torch.h>

#include <map>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace harness::optim {
namespace {

// The tensors of one kernel call: the kernel needs one device and one dtype throughout.
struct Batch {
  std::vector<at::Tensor> parameters, gradients, exp_avgs, exp_avg_sqs, steps;
};

void run(Batch& batch, const AdamWHyperparameters& o) {
  if (batch.parameters.empty()) return;
  at::_fused_adamw_(batch.parameters, batch.gradients, batch.exp_avgs, batch.exp_avg_sqs, /*max_exp_avg_sqs=*/{},
                    batch.steps, o.lr, o.beta1, o.beta2, o.weight_decay, o.eps, /*amsgrad=*/false,
                    /*maximize=*/false);
}

// The step count as the kernel reads it: a float scalar on the parameters' device.
at::Tensor step_tensor(int64_t step, const at::Tensor& like) {
  return at::full({}, static_cast<double>(step), like.options().dtype(at::kFloat));
}

}  // namespace

void fused_adamw_update(const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& gradients,
                        const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                        int64_t step, const AdamWHyperparameters& options) {
  if (gradients.size() != parameters.size() || exp_avgs.size() != parameters.size() ||
      exp_avg_sqs.size() != parameters.size()) {
    throw std::invalid_argument("fused_adamw_update: parameters, gradients and moments differ in number");
  }
  torch::NoGradGuard no_grad;
  Batch batch{parameters, gradients, exp_avgs, exp_avg_sqs, {}};
  for (const at::Tensor& p : parameters) batch.steps.push_back(step_tensor(step, p));
  run(batch, options);
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (options.amsgrad()) throw std::invalid_argument("FusedAdamW: AMSGrad is not supported");
    AdamWHyperparameters h;
    h.lr = options.lr();
    h.beta1 = std::get<0>(options.betas());
    h.beta2 = std::get<1>(options.betas());
    h.eps = options.eps();
    h.weight_decay = options.weight_decay();
    // One kernel call per (device, dtype): a pipeline's parameters sit on several devices.
    std::map<std::pair<std::string, at::ScalarType>, Batch> batches;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse()) throw std::invalid_argument("FusedAdamW: sparse gradients are not supported");
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
      s.step(s.step() + 1);
      Batch& batch = batches[{p.device().str(), p.scalar_type()}];
      batch.parameters.push_back(p);
      batch.gradients.push_back(p.grad());
      batch.exp_avgs.push_back(s.exp_avg());
      batch.exp_avg_sqs.push_back(s.exp_avg_sq());
      batch.steps.push_back(step_tensor(s.step(), p));
    }
    for (auto& [key, batch] : batches) run(batch, h);
  }
  return loss;
}

}  // namespace harness::optim
