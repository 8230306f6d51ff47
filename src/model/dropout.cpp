// Per-thread dropout streams (see dropout.h).
#include "harness/model/dropout.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dropout_kernel.h"
#include "elementwise_grain.h"

namespace harness::model {
namespace {

thread_local std::optional<at::Generator> thread_generator;

// Runs fn(first, end) over [0, n) split into ranges, each starting on an even element (a draw's
// first word), however many threads share them.
template <typename Fn>
void for_each_even_range(int64_t n, const Fn& fn) {
  at::parallel_for(0, (n + 1) / 2, detail::kElementwiseGrain / 2,
                   [&](int64_t begin, int64_t end) { fn(2 * begin, std::min(2 * end, n)); });
}

// The CPU mask's parameters: the seed, one 64-bit draw from the generator, and the largest kept
// 32-bit word; nullopt when 1 - p rounds to below 2^-32 and nothing is kept.
struct KeepRule {
  uint64_t seed;
  std::optional<uint32_t> last_kept;
};

KeepRule draw_keep_rule(double p, at::Generator& generator) {
  KeepRule rule{};
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    rule.seed = at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
  }
  const auto threshold = static_cast<uint64_t>(std::llround(std::ldexp(1.0 - p, 32)));  // keep probability x 2^32
  if (threshold > 0) rule.last_kept = static_cast<uint32_t>(threshold - 1);
  return rule;
}

bool fused_on(const at::Tensor& x) {
  return x.is_cpu() && x.layout() == at::kStrided &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// 1 / (1 - p) in x's dtype, as a float: the factor torch's x * mask multiplies by.
float kept_scale(double p, at::ScalarType dtype) {
  const auto scale = static_cast<float>(1.0 / (1.0 - p));
  return dtype == at::kBFloat16 ? static_cast<float>(c10::BFloat16(scale)) : scale;
}

// x * keep mask in one pass over x, saving the mask as bytes for the backward (a quarter of a
// float mask's memory). The same values, bit for bit, as x * dropout_keep_mask(x, p, generator)
// drawn from the same generator state, gradients included; first-order only.
class FusedDropout : public torch::autograd::Function<FusedDropout> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double p,
                            KeepRule rule) {
    const at::Tensor in = x.contiguous();
    at::Tensor y = at::empty(in.sizes(), in.options());
    at::Tensor keep = at::empty(in.sizes(), in.options().dtype(at::kByte));
    const float scale = kept_scale(p, in.scalar_type());
    if (!rule.last_kept) {
      keep.zero_();
      y = in * 0;  // NaN and infinity stay NaN, as in x * mask
    } else {
      const int64_t n = in.numel();
      uint8_t* kept = keep.data_ptr<uint8_t>();
      const bool bf16 = in.scalar_type() == at::kBFloat16;
      const void* src = in.data_ptr();
      void* dst = y.data_ptr();
      for_each_even_range(n, [&](int64_t begin, int64_t end) {
        if (bf16) {
          detail::dropout_forward_bf16(static_cast<const uint16_t*>(src) + begin, static_cast<uint16_t*>(dst) + begin,
                                       kept + begin, begin, end - begin, rule.seed, *rule.last_kept, scale);
        } else {
          detail::dropout_forward_f32(static_cast<const float*>(src) + begin, static_cast<float*>(dst) + begin,
                                      kept + begin, begin, end - begin, rule.seed, *rule.last_kept, scale);
        }
      });
    }
    ctx->save_for_backward({keep});
    ctx->saved_data["scale"] = static_cast<double>(scale);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor keep = ctx->get_saved_variables()[0];
    const auto scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const at::Tensor grad = grads[0].contiguous();
    at::Tensor dx = at::empty(grad.sizes(), grad.options());
    const uint8_t* kept = keep.data_ptr<uint8_t>();
    const bool bf16 = grad.scalar_type() == at::kBFloat16;
    TORCH_CHECK(bf16 || grad.scalar_type() == at::kFloat, "dropout backward: gradient of dtype ",
                grad.scalar_type(), ", expected float or bfloat16");
    const void* src = grad.data_ptr();
    void* dst = dx.data_ptr();
    at::parallel_for(0, grad.numel(), detail::kElementwiseGrain, [&](int64_t begin, int64_t end) {
      if (bf16) {
        detail::dropout_backward_bf16(static_cast<const uint16_t*>(src) + begin, kept + begin,
                                      static_cast<uint16_t*>(dst) + begin, end - begin, scale);
      } else {
        detail::dropout_backward_f32(static_cast<const float*>(src) + begin, kept + begin,
                                     static_cast<float*>(dst) + begin, end - begin, scale);
      }
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// x dropped with probability p, the mask drawn from `generator`.
at::Tensor drop(const at::Tensor& x, double p, at::Generator& generator) {
  if (fused_on(x)) return FusedDropout::apply(x, p, draw_keep_rule(p, generator));
  return x * dropout_keep_mask(x, p, generator);
}

}  // namespace

DropoutGeneratorScope::DropoutGeneratorScope(at::Generator generator)
    : previous_(std::move(thread_generator)) {
  thread_generator = std::move(generator);
}

DropoutGeneratorScope::~DropoutGeneratorScope() { thread_generator = std::move(previous_); }

std::optional<at::Generator> current_dropout_generator() { return thread_generator; }

at::Generator make_generator(const c10::Device& device, uint64_t seed) {
  if (device.is_cpu()) return at::detail::createCPUGenerator(seed);
  // Any other device: a clone of its default generator (same type), then reseeded, which also
  // resets a Philox offset. The clone reads the default's state under its lock.
  at::Generator default_generator = at::globalContext().defaultGenerator(device);
  at::Generator generator;
  {
    std::lock_guard<std::mutex> lock(default_generator.mutex());
    generator = default_generator.clone();
  }
  generator.set_current_seed(seed);
  return generator;
}

at::Tensor with_default_generator_seeded(const c10::Device& device, uint64_t seed,
                                         const std::function<at::Tensor()>& fn) {
  static std::mutex devices_mutex;
  static std::map<std::string, std::unique_ptr<std::mutex>> per_device;
  std::mutex* turn = nullptr;
  {
    std::lock_guard<std::mutex> lock(devices_mutex);
    auto& slot = per_device[device.str()];
    if (!slot) slot = std::make_unique<std::mutex>();
    turn = slot.get();
  }
  std::lock_guard<std::mutex> my_turn(*turn);
  at::Generator generator = at::globalContext().defaultGenerator(device);
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    saved = generator.get_state();
    generator.set_current_seed(seed);
  }
  struct Restore {
    at::Generator& generator;
    const at::Tensor& saved;
    ~Restore() {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(saved);
    }
  } restore{generator, saved};
  return fn();
}

at::Tensor dropout_keep_mask(const at::Tensor& like, double p, at::Generator& generator) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout_keep_mask: p = ", p, " must be in [0, 1)");
  if (!like.is_cpu()) {
    at::Tensor keep = at::empty_like(like, at::MemoryFormat::Contiguous).bernoulli_(1.0 - p, generator);
    return keep.div_(1.0 - p);
  }
  const KeepRule rule = draw_keep_rule(p, generator);
  at::Tensor keep =
      at::empty(like.sizes(), like.options().dtype(at::kByte).memory_format(at::MemoryFormat::Contiguous));
  if (!rule.last_kept) {
    keep.zero_();
  } else {
    uint8_t* kept = keep.data_ptr<uint8_t>();
    for_each_even_range(keep.numel(), [&](int64_t begin, int64_t end) {
      detail::dropout_keep_bits(kept + begin, begin, end - begin, rule.seed, *rule.last_kept);
    });
  }
  return keep.to(like.scalar_type()).mul_(static_cast<double>(1.0 / (1.0 - p)));
}

std::optional<at::Generator> mask_generator(const c10::Device& device) {
  if (thread_generator) return thread_generator;
  if (device.is_cpu()) return at::globalContext().defaultGenerator(device);
  return std::nullopt;
}

at::Tensor dropout(const at::Tensor& x, torch::nn::Dropout& module) {
  const double p = module->options.p();
  std::optional<at::Generator> generator = mask_generator(x.device());
  if (!module->is_training() || p == 0.0 || !generator) return module(x);
  if (p >= 1.0) return x * 0;
  return drop(x, p, *generator);
}

at::Tensor attention_with_dropout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask, bool is_causal, double p,
                                  double scale, at::Generator& generator) {
  const int64_t T = q.size(-2), S = k.size(-2), D = q.size(-1);
  TORCH_CHECK(!is_causal || T == S, "attention_with_dropout: is_causal needs as many queries as keys, got ",
              T, " and ", S);
  // scores = mask bias + scale * q k^T in one baddbmm (the bias, 0 where attended and -inf where
  // not, is copied into the output and the product added to it): no separate passes to scale and
  // to mask the scores, forward or backward.
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end() - 2);  // the batch dimensions, then T, S
  shape.push_back(T);
  shape.push_back(S);
  at::Tensor bias;
  if (mask || is_causal) {
    const at::Tensor attend = mask ? *mask : at::ones({T, S}, q.options().dtype(at::kBool)).tril();
    bias = at::zeros(attend.sizes(), q.options()).masked_fill_(attend.logical_not(),
                                                               -std::numeric_limits<float>::infinity());
  } else {
    bias = at::zeros({T, S}, q.options());
  }
  const at::Tensor q3 = q.reshape({-1, T, D}), k3 = k.reshape({-1, S, D});
  bias = bias.expand(shape).reshape({-1, T, S});  // a view for a [T, S] mask; any broadcastable mask works
  const at::Tensor scores =
      at::baddbmm(bias, q3, k3.transpose(1, 2), /*beta=*/1.0, /*alpha=*/scale).view(shape);
  // Softmax statistics in fp32 whatever the matmuls ran in (CPU autocast would keep bf16 here).
  at::Tensor probabilities = scores.scalar_type() == at::kFloat
                                 ? at::softmax(scores, -1)
                                 : at::softmax(scores, -1, at::kFloat).to(scores.scalar_type());
  if (p >= 1.0) {
    probabilities = probabilities * 0;
  } else if (p > 0.0) {
    probabilities = drop(probabilities, p, generator);
  }
  return at::matmul(probabilities, v);
}

}  // namespace harness::model
