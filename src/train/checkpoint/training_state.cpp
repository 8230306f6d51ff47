// AdamW state and generator states for checkpoints (see training_state.h).
#include "harness/train/checkpoint/training_state.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <stdexcept>

#include "harness/model/safetensors.h"

namespace harness::train {

NamedParameters named_parameters_of(torch::nn::Module& module) {
  NamedParameters out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}
namespace {

std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

OptimizerState capture_adamw_state(torch::optim::AdamW& optimizer, const NamedParameters& parameters) {
  for (const auto& group : optimizer.param_groups()) {
    if (static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()) {
      throw std::invalid_argument("checkpoints do not store AMSGrad's max_exp_avg_sq");
    }
  }
  OptimizerState out;
  auto& states = optimizer.state();
  for (const auto& [name, parameter] : parameters) {
    auto it = states.find(parameter.unsafeGetTensorImpl());
    if (it == states.end()) continue;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out[name] = {s.step(), s.exp_avg().detach().to(torch::kCPU, torch::kFloat).clone(),
                 s.exp_avg_sq().detach().to(torch::kCPU, torch::kFloat).clone()};
  }
  return out;
}

void restore_adamw_state(torch::optim::AdamW& optimizer, const NamedParameters& parameters,
                         const OptimizerState& state) {
  std::map<std::string, at::Tensor> by_name(parameters.begin(), parameters.end());
  for (const auto& [name, s] : state) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      throw std::invalid_argument("optimizer state for " + name + ", which the model does not have");
    }
    for (const at::Tensor* moment : {&s.exp_avg, &s.exp_avg_sq}) {
      if (!moment->defined() || moment->sizes() != it->second.sizes()) {
        throw std::invalid_argument("optimizer state of " + name + " has shape " +
                                    (moment->defined() ? shape_of(*moment) : "none") +
                                    ", the parameter " + shape_of(it->second));
      }
    }
  }
  auto& states = optimizer.state();
  torch::NoGradGuard no_grad;
  for (const auto& [name, parameter] : parameters) {
    void* key = parameter.unsafeGetTensorImpl();
    states.erase(key);
    auto it = state.find(name);
    if (it == state.end()) continue;
    auto restored = std::make_unique<torch::optim::AdamWParamState>();
    const auto options = parameter.options().requires_grad(false);
    restored->step(it->second.step);
    restored->exp_avg(it->second.exp_avg.to(options).clone().contiguous());
    restored->exp_avg_sq(it->second.exp_avg_sq.to(options).clone().contiguous());
    states[key] = std::move(restored);
  }
}

OptimizerStateWriter::OptimizerStateWriter(const std::string& path, const std::vector<Parameter>& parameters) {
  std::vector<model::SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata{{"format", "pt"}, {"optimizer", "AdamW"}};
  for (const Parameter& p : parameters) {
    entries.push_back({p.name + ".exp_avg", torch::kFloat, p.shape});
    entries.push_back({p.name + ".exp_avg_sq", torch::kFloat, p.shape});
    metadata[p.name + ".step"] = std::to_string(p.step);
  }
  file_ = std::make_unique<model::SafetensorsWriter>(path, std::move(entries), metadata);
}

OptimizerStateWriter::~OptimizerStateWriter() = default;

void OptimizerStateWriter::add(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
  file_->append(exp_avg.to(torch::kFloat));
  file_->append(exp_avg_sq.to(torch::kFloat));
}

void OptimizerStateWriter::finish() { file_->finish(); }

void write_optimizer_state(const std::string& path, const OptimizerState& state) {
  std::vector<OptimizerStateWriter::Parameter> parameters;
  for (const auto& [name, s] : state) parameters.push_back({name, s.step, s.exp_avg.sizes().vec()});
  OptimizerStateWriter file(path, parameters);
  for (const auto& [name, s] : state) file.add(s.exp_avg, s.exp_avg_sq);
  file.finish();
}

OptimizerState read_optimizer_state(const std::string& path) {
  model::SafetensorsContents contents = model::read_safetensors_with_metadata(path);
  if (contents.metadata.count("optimizer") == 0 || contents.metadata.at("optimizer") != "AdamW") {
    throw std::runtime_error(path + ": not an AdamW state (metadata \"optimizer\" is not \"AdamW\")");
  }
  OptimizerState out;
  for (auto& [key, tensor] : contents.tensors) {
    std::string name;
    bool first;
    if (ends_with(key, ".exp_avg_sq")) {
      name = key.substr(0, key.size() - 11);
      first = false;
    } else if (ends_with(key, ".exp_avg")) {
      name = key.substr(0, key.size() - 8);
      first = true;
    } else {
      throw std::runtime_error(path + ": tensor " + key + " is neither <name>.exp_avg nor <name>.exp_avg_sq");
    }
    (first ? out[name].exp_avg : out[name].exp_avg_sq) = tensor.to(torch::kFloat);
  }
  for (auto& [name, s] : out) {
    if (!s.exp_avg.defined() || !s.exp_avg_sq.defined()) {
      throw std::runtime_error(path + ": " + name + " has only one of exp_avg and exp_avg_sq");
    }
    auto it = contents.metadata.find(name + ".step");
    if (it == contents.metadata.end()) throw std::runtime_error(path + ": no step for " + name);
    try {
      size_t used = 0;
      s.step = std::stoll(it->second, &used);
      if (used != it->second.size() || s.step < 0) throw std::invalid_argument("bad");
    } catch (const std::exception&) {
      throw std::runtime_error(path + ": step of " + name + " is '" + it->second +
                               "', expected a non-negative integer");
    }
  }
  return out;
}

at::Tensor bytes_to_tensor(const std::string& bytes) {
  at::Tensor t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  if (!bytes.empty()) std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

std::string tensor_to_bytes(const at::Tensor& tensor) {
  at::Tensor t = tensor.to(torch::kCPU).contiguous();
  if (t.scalar_type() != torch::kUInt8) throw std::invalid_argument("tensor_to_bytes: not uint8");
  return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
}

GeneratorStates capture_generator_states(const std::vector<c10::Device>& devices) {
  GeneratorStates out;
  out["cpu"] = tensor_to_bytes(at::detail::getDefaultCPUGenerator().get_state());
  for (const c10::Device& device : devices) {
    if (!device.is_cuda()) continue;
    at::Generator generator = at::globalContext().defaultGenerator(device);
    out[device.str()] = tensor_to_bytes(generator.get_state());
  }
  return out;
}

void restore_generator_states(const GeneratorStates& states) {
  for (const auto& [name, bytes] : states) {
    if (name == "cpu") {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(bytes_to_tensor(bytes));
      continue;
    }
    const c10::Device device(name);
    if (!device.is_cuda() || !torch::cuda::is_available() ||
        device.index() >= static_cast<int>(torch::cuda::device_count())) {
      throw std::runtime_error("generator state for " + name + ", which this run does not have");
    }
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(bytes_to_tensor(bytes));
  }
}

std::string to_hex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::string from_hex(const std::string& hex, const std::string& what) {
  auto value = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw std::runtime_error(what + ": '" + std::string(1, c) + "' is not a lowercase hex digit");
  };
  if (hex.size() % 2 != 0) throw std::runtime_error(what + ": odd number of hex digits");
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>(value(hex[2 * i]) * 16 + value(hex[2 * i + 1]));
  }
  return out;
}

}  // namespace harness::train
