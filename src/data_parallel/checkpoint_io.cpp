// A .pth writer: the dict is pickled without type tags (torch::pickle_save would wrap it in
// torch.jit._pickle.restore_type_tag, which weights_only loading refuses), and the tensors go into
// the zip archive next to data.pkl, as torch.save lays them out.
#include "harness/data_parallel/checkpoint_io.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>

#include <set>
#include <stdexcept>

namespace harness::data_parallel {

void save_tensor_dict_pth(const std::string& path,
                          const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  std::set<std::string> names;
  for (const auto& [name, tensor] : tensors) {
    if (name.empty()) throw std::invalid_argument(path + ": a tensor has an empty name");
    if (!names.insert(name).second) {
      throw std::invalid_argument(path + ": tensor name " + name + " appears twice");
    }
    if (!tensor.defined()) {
      throw std::invalid_argument(path + ": tensor " + name + " is undefined");
    }
    dict.insert(name, tensor.detach().to(at::kCPU).contiguous().clone());
  }

  // No tensor table: tensors are then pickled as torch.save does (_rebuild_tensor_v2 over a
  // persistent storage id), the data collected in tensorData(); with a table the pickler would
  // emit torch.jit._pickle.build_tensor_from_id, which weights_only loading refuses.
  std::string pickle;
  torch::jit::Pickler pickler([&pickle](const char* data, size_t size) { pickle.append(data, size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
                              /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();

  try {
    caffe2::serialize::PyTorchStreamWriter writer(path);
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(),
                                       pickler.tensorData(), writer);
    writer.writeEndOfFile();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    throw std::runtime_error(path + ": cannot write the tensor file: " +
                             what.substr(0, what.find('\n')));
  }
}

}  // namespace harness::data_parallel
