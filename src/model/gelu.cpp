// gelu_tanh (see gelu.h): a custom autograd function around the loops of gelu_kernel.cpp.
#include "harness/model/gelu.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "elementwise_grain.h"
#include "gelu_kernel.h"

namespace harness::model {
namespace {

bool ours(const at::Tensor& x) {
  return x.is_cpu() && x.layout() == at::kStrided &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// The float array behind t: t itself when it is contiguous float, else a contiguous float copy.
at::Tensor as_float(const at::Tensor& t) {
  return t.to(at::kFloat, /*non_blocking=*/false, /*copy=*/false).contiguous();
}

class GeluTanh : public torch::autograd::Function<GeluTanh> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    const at::Tensor in = as_float(x);
    at::Tensor out = at::empty(in.sizes(), in.options());
    const float* src = in.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, in.numel(), detail::kElementwiseGrain, [&](int64_t begin, int64_t end) {
      detail::gelu_tanh_forward(src + begin, dst + begin, end - begin);
    });
    return out.to(x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor in = as_float(x), grad = as_float(grads[0]);
    at::Tensor dx = at::empty(in.sizes(), in.options());
    const float* g = grad.data_ptr<float>();
    const float* src = in.data_ptr<float>();
    float* dst = dx.data_ptr<float>();
    at::parallel_for(0, in.numel(), detail::kElementwiseGrain, [&](int64_t begin, int64_t end) {
      detail::gelu_tanh_backward(g + begin, src + begin, dst + begin, end - begin);
    });
    return {dx.to(x.scalar_type())};
  }
};

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!ours(x)) return at::gelu(x, "tanh");
  return GeluTanh::apply(x);
}

}  // namespace harness::model
