// Per-thread dropout streams (see dropout.h).
#include "harness/model/dropout.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace harness::model {
namespace {

thread_local std::optional<at::Generator> thread_generator;

// splitmix64's output function: a bijection of 64-bit words whose outputs, for inputs a fixed odd
// step apart, pass BigCrush (Steele et al., "Fast splittable pseudorandom number generators").
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// out[i] = scale where element i is kept, 0 where dropped: element i's 32 random bits are one half
// of mix64(seed + (i / 2) * golden step), kept when below `threshold` (keep probability x 2^32).
// A function of (seed, i) alone, so the mask does not depend on how many threads fill it.
template <typename T>
void fill_keep_mask(T* out, int64_t n, uint64_t seed, uint64_t threshold, T scale) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
  const T zero(0);
  at::parallel_for(0, (n + 1) / 2, /*grain_size=*/16384, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint64_t bits = mix64(seed + static_cast<uint64_t>(pair) * kGolden);
      const int64_t i = 2 * pair;
      out[i] = (bits & 0xFFFFFFFFULL) < threshold ? scale : zero;
      if (i + 1 < n) out[i + 1] = (bits >> 32) < threshold ? scale : zero;
    }
  });
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
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    seed = at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
  }
  const auto threshold = static_cast<uint64_t>(std::llround(std::ldexp(1.0 - p, 32)));
  at::Tensor keep = at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keep.scalar_type(), "dropout_keep_mask", [&] {
    fill_keep_mask<scalar_t>(keep.data_ptr<scalar_t>(), keep.numel(), seed, threshold,
                             static_cast<scalar_t>(1.0 / (1.0 - p)));
  });
  return keep;
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
  return x * dropout_keep_mask(x, p, *generator);
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
    probabilities = probabilities * dropout_keep_mask(probabilities, p, generator);
  }
  return at::matmul(probabilities, v);
}

}  // namespace harness::model
