// The model-parallel random stream (see parallel_rng.h).
#include "harness/tensor_parallel/parallel_rng.h"

#include <ATen/Context.h>
#include <torch/torch.h>

#include <limits>

namespace harness::tensor_parallel {
namespace {

constexpr uint64_t kSeedOffset = 2718;  // as Megatron's model-parallel seed offset

// Puts `state` into `generator` on construction and restores the previous state on destruction.
class GeneratorStateSwap {
 public:
  GeneratorStateSwap(at::Generator generator, const at::Tensor& state)
      : generator_(std::move(generator)), saved_(generator_.get_state()) {
    generator_.set_state(state);
  }
  ~GeneratorStateSwap() { generator_.set_state(saved_); }
  at::Tensor current() const { return generator_.get_state(); }

 private:
  at::Generator generator_;
  at::Tensor saved_;
};

}  // namespace

at::Tensor ParallelRegionRng::run(const c10::Device& device, const std::function<at::Tensor()>& fn) {
  const auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  at::Generator generator = at::globalContext().defaultGenerator(device);
  auto state = states_.find(key);
  if (state == states_.end()) {
    const int64_t draw = at::randint(std::numeric_limits<int32_t>::max(), {1}, at::kLong).item<int64_t>();
    const at::Tensor saved = generator.get_state();
    generator.set_current_seed(static_cast<uint64_t>(draw) + kSeedOffset + static_cast<uint64_t>(tensor_rank_));
    state = states_.emplace(key, generator.get_state()).first;
    generator.set_state(saved);
  }
  GeneratorStateSwap swap(generator, state->second);
  at::Tensor out = fn();
  state->second = swap.current();
  return out;
}

std::map<std::string, at::Tensor> ParallelRegionRng::states() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, state] : states_) {
    const c10::Device device(static_cast<c10::DeviceType>(key.first), static_cast<c10::DeviceIndex>(key.second));
    out[device.str()] = state.clone();
  }
  return out;
}

void ParallelRegionRng::set_states(const std::map<std::string, at::Tensor>& states) {
  states_.clear();
  for (const auto& [name, state] : states) {
    const c10::Device device(name);
    states_[{static_cast<int>(device.type()), static_cast<int>(device.index())}] = state.clone();
  }
}

}  // namespace harness::tensor_parallel
