// Dropout whose random stream a task can choose. Concurrent pipeline tasks on CPU lanes would
// otherwise all draw from torch's one process-wide CPU generator, so which micro-batch gets which
// mask would depend on thread timing. A task that installs a DropoutGeneratorScope draws every
// mask of GPT-2's dropouts (embedding, attention probabilities, residual, MLP) from its own
// generator instead; without one, CPU masks come from the default CPU generator, and on other
// devices the modules behave exactly as torch::nn::Dropout and scaled_dot_product_attention do.
// On a GPU, where the fused kernels (flash attention's dropout among them) draw only from the
// device's default generator, a task reseeds that generator for its duration instead
// (with_default_generator_seeded).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/dropout.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace harness::model {

// Installs `generator` as the calling thread's dropout stream until destroyed (scopes nest).
class DropoutGeneratorScope {
 public:
  explicit DropoutGeneratorScope(at::Generator generator);
  ~DropoutGeneratorScope();
  DropoutGeneratorScope(const DropoutGeneratorScope&) = delete;
  DropoutGeneratorScope& operator=(const DropoutGeneratorScope&) = delete;

 private:
  std::optional<at::Generator> previous_;
};

// The calling thread's dropout stream, if a scope installed one.
std::optional<at::Generator> current_dropout_generator();

// A fresh generator of `device`'s type seeded with `seed` (CPU: mt19937; CUDA: Philox, offset 0).
at::Generator make_generator(const c10::Device& device, uint64_t seed);

// Runs fn with `device`'s default generator reseeded to `seed` (Philox offset 0) and puts its
// state back afterwards, also when fn throws. One task per device at a time: a second caller for
// the same device waits, so two workers sharing a GPU take turns (their kernels share its stream
// anyway). For GPUs; on the CPU, whose one generator all lanes share, use DropoutGeneratorScope.
at::Tensor with_default_generator_seeded(const c10::Device& device, uint64_t seed,
                                         const std::function<at::Tensor()>& fn);

// 1 / (1 - p) where an element is kept, 0 where it is dropped (probability p), shaped like `like`
// (contiguous, its dtype and device). On the CPU: one 64-bit draw from `generator` seeds a
// counter-based hash (splitmix64's) that gives every element its own 32 random bits, so a mask
// costs about a nanosecond per element instead of torch's serial mt19937 Bernoulli (about eight
// on a CPU where ATen does not use MKL's), and does not depend on the thread count. Elsewhere:
// bernoulli_(1 - p, generator) / (1 - p), torch's formula. p in [0, 1).
at::Tensor dropout_keep_mask(const at::Tensor& like, double p, at::Generator& generator);

// The generator GPT-2's dropouts draw their masks from on `device`: the thread's stream; without
// one, on the CPU, the default CPU generator; elsewhere none (torch's modules and fused kernels,
// which draw from the device's default generator themselves).
std::optional<at::Generator> mask_generator(const c10::Device& device);

// module(x): in training, x * dropout_keep_mask(x, p, *mask_generator(x.device())); without a
// mask generator, in eval mode or with p = 0, torch::nn::Dropout itself. On the CPU, in fp32 and
// bf16, the product is one pass that keeps the mask as bytes for the backward: the same values
// bit for bit, about 8x faster than drawing the mask and multiplying (gradients first-order).
at::Tensor dropout(const at::Tensor& x, torch::nn::Dropout& module);

// Attention probabilities dropped with probability p (dropout_keep_mask). Used by the attention
// whenever mask_generator() gives one (scaled_dot_product_attention cannot take a generator, and
// on a CPU with dropout it takes the same unfused path): softmax(q k^T * scale + mask) with
// dropout, times v. `mask` is boolean (true = attend) or absent with is_causal, which needs
// as many queries as keys (the top-left aligned triangle scaled_dot_product_attention uses).
at::Tensor attention_with_dropout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask, bool is_causal, double p,
                                  double scale, at::Generator& generator);

}  // namespace harness::model
