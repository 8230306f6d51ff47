// Dropout whose random stream a task can choose. Concurrent pipeline tasks on CPU lanes would
// otherwise all draw from torch's one process-wide CPU generator, so which micro-batch gets which
// mask would depend on thread timing. A task that installs a DropoutGeneratorScope draws every
// mask of GPT-2's dropouts (embedding, attention probabilities, residual, MLP) from its own
// generator instead; without one, the modules behave exactly as torch::nn::Dropout and
// scaled_dot_product_attention do. On a GPU, where the fused kernels (flash attention's dropout
// among them) draw only from the device's default generator, a task reseeds that generator for
// its duration instead (with_default_generator_seeded).
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

// module(x), drawing the mask from the thread's stream when there is one: x * bernoulli(1 - p) /
// (1 - p), torch's own CPU formula, so on the CPU with the same generator state the mask is
// torch::nn::Dropout's.
at::Tensor dropout(const at::Tensor& x, torch::nn::Dropout& module);

// Attention probabilities dropped with probability p. Used by the attention when a stream is
// installed (scaled_dot_product_attention cannot take a generator): softmax(q k^T * scale + mask)
// with dropout, times v. `mask` is boolean (true = attend) or absent with is_causal, which needs
// as many queries as keys (the top-left aligned triangle scaled_dot_product_attention uses).
at::Tensor attention_with_dropout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask, bool is_causal, double p,
                                  double scale, at::Generator& generator);

}  // namespace harness::model
