// Megatron's model-parallel random stream: dropout on tensors that are split over the
// tensor-parallel ranks (the attention probabilities of this rank's heads) draws from a stream of
// its own, seeded differently on each rank, so that heads on different ranks get independent
// masks. Everything else keeps using the default generator, which must stay identical on all ranks
// of the group (dropout on replicated activations has to agree); run() leaves it exactly as it was.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <string>
#include <utility>

namespace harness::tensor_parallel {

class ParallelRegionRng {
 public:
  explicit ParallelRegionRng(int tensor_rank) : tensor_rank_(tensor_rank) {}

  // Runs fn with `device`'s default generator switched to this rank's stream, then switches back
  // (also when fn throws). The stream of a device is seeded on first use from one draw of the CPU
  // default generator (the same draw on every rank of the group, so they stay in step) plus an
  // offset and the rank.
  at::Tensor run(const c10::Device& device, const std::function<at::Tensor()>& fn);

  // The streams seeded so far, by device name ("cpu", "cuda:0"), and their replacement: a
  // resumed run continues each stream where the checkpoint left it.
  std::map<std::string, at::Tensor> states() const;
  void set_states(const std::map<std::string, at::Tensor>& states);

 private:
  int tensor_rank_;
  std::map<std::pair<int, int>, at::Tensor> states_;  // (device type, index) -> generator state
};

}  // namespace harness::tensor_parallel
