// Writing a name -> tensor dictionary as a .pth file that Python's torch.load(path) (weights_only
// by default) returns as a plain dict of tensors: the gradient files of run_data_parallel --pytest.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace harness::data_parallel {

// Tensors are written from CPU, contiguous and detached (copied when they are not), in the given
// order. Throws std::invalid_argument for an empty or duplicate name or an undefined tensor, and
// std::runtime_error naming the path when the file cannot be written.
void save_tensor_dict_pth(const std::string& path,
                          const std::vector<std::pair<std::string, at::Tensor>>& tensors);

}  // namespace harness::data_parallel
