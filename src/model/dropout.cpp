// Per-thread dropout streams (see dropout.h).
#include "harness/model/dropout.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/torch.h>

#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace harness::model {
namespace {

thread_local std::optional<at::Generator> thread_generator;

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

at::Tensor dropout(const at::Tensor& x, torch::nn::Dropout& module) {
  const double p = module->options.p();
  if (!thread_generator || !module->is_training() || p == 0.0) return module(x);
  if (p == 1.0) return x * 0;
  at::Tensor keep = at::empty_like(x).bernoulli_(1.0 - p, *thread_generator);
  keep.div_(1.0 - p);
  return x * keep;
}

at::Tensor attention_with_dropout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask, bool is_causal, double p,
                                  double scale, at::Generator& generator) {
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  const int64_t T = q.size(-2), S = k.size(-2);
  TORCH_CHECK(!is_causal || T == S, "attention_with_dropout: is_causal needs as many queries as keys, got ",
              T, " and ", S);
  if (mask) {
    scores = scores.masked_fill(mask->logical_not(), -std::numeric_limits<float>::infinity());
  } else if (is_causal) {
    const at::Tensor causal = at::ones({T, S}, q.options().dtype(at::kBool)).tril();
    scores = scores.masked_fill(causal.logical_not(), -std::numeric_limits<float>::infinity());
  }
  // Softmax statistics in fp32 whatever the matmuls ran in (CPU autocast would keep bf16 here).
  at::Tensor probabilities = scores.scalar_type() == at::kFloat
                                 ? at::softmax(scores, -1)
                                 : at::softmax(scores, -1, at::kFloat).to(scores.scalar_type());
  if (p > 0.0) {
    at::Tensor keep = at::empty_like(probabilities).bernoulli_(1.0 - p, generator);
    keep.div_(1.0 - p);
    probabilities = probabilities * keep;
  }
  return at::matmul(probabilities, v);
}

}  // namespace harness::model
