// The parts of a training run's state that live outside the weights: AdamW's per-parameter state
// under Hugging Face parameter names, and the random generators' states, in forms a checkpoint
// stores (a safetensors file, bytes) and restores exactly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class AdamW;
}

namespace harness::model {
class SafetensorsWriter;
}

namespace harness::train {

using NamedParameters = std::vector<std::pair<std::string, at::Tensor>>;

// The parameters of `module` as (name, tensor), in registration order.
NamedParameters named_parameters_of(torch::nn::Module& module);

struct AdamWParamState {
  int64_t step = 0;
  at::Tensor exp_avg;     // on the CPU, the parameter's shape
  at::Tensor exp_avg_sq;
};
// Parameter name -> its state; parameters the optimizer has not stepped yet are absent.
using OptimizerState = std::map<std::string, AdamWParamState>;

// Copies (to the CPU) the state of each named parameter of `optimizer`. Throws for AMSGrad (whose
// extra moment is not stored).
OptimizerState capture_adamw_state(torch::optim::AdamW& optimizer, const NamedParameters& parameters);

// Replaces the optimizer's state of every named parameter by `state` (moved to the parameter's
// device and dtype); parameters absent from `state` are left without state. Errors name the
// parameter: a state for a name that is not among `parameters`, or a shape that differs.
void restore_adamw_state(torch::optim::AdamW& optimizer, const NamedParameters& parameters,
                         const OptimizerState& state);

// optimizer.safetensors: tensors "<name>.exp_avg" and "<name>.exp_avg_sq" (float32), and the
// steps in the metadata as "<name>.step" -> decimal, next to "optimizer": "AdamW".
void write_optimizer_state(const std::string& path, const OptimizerState& state);

// The same file written one parameter at a time (a split model's moments, gathered in turn):
// `parameters` lists each one's name, step and unsplit shape, in the order of the add() calls;
// finish() moves the file into place (an unfinished one is removed).
class OptimizerStateWriter {
 public:
  struct Parameter {
    std::string name;
    int64_t step = 0;
    std::vector<int64_t> shape;
  };
  OptimizerStateWriter(const std::string& path, const std::vector<Parameter>& parameters);
  ~OptimizerStateWriter();
  void add(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq);
  void finish();

 private:
  std::unique_ptr<model::SafetensorsWriter> file_;
};
OptimizerState read_optimizer_state(const std::string& path);

// The default generators' states of the CPU and of each CUDA device in `devices` (others are
// ignored), by device name ("cpu", "cuda:0"), as opaque bytes.
using GeneratorStates = std::map<std::string, std::string>;
GeneratorStates capture_generator_states(const std::vector<c10::Device>& devices);
// Sets every generator named in `states`; a CUDA state for a device that is absent is an error.
void restore_generator_states(const GeneratorStates& states);

// Bytes <-> lowercase hex (generator states inside JSON).
std::string to_hex(const std::string& bytes);
std::string from_hex(const std::string& hex, const std::string& what);

at::Tensor bytes_to_tensor(const std::string& bytes);  // uint8 CPU tensor
std::string tensor_to_bytes(const at::Tensor& tensor);  // uint8 tensor -> its bytes

}  // namespace harness::train
