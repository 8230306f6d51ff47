// Hugging Face's safetensors format, read and written by a parser of our own that validates
// everything it reads, and loading/saving GPT-2 in Hugging Face's layout (config.json +
// model.safetensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "harness/model/gpt2.h"

namespace harness::model {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct SafetensorsContents {
  NamedTensors tensors;  // in the file's order (by data offset), i.e. as written
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// Parses a whole safetensors file held in memory. Accepts dtypes F32, F16 and BF16 (kept as
// they are). Every malformation is a std::runtime_error naming `origin` and the tensor.
SafetensorsContents parse_safetensors(const uint8_t* data, size_t size,
                                      const std::string& origin = "<memory>");

// Reads `path` (validated as parse_safetensors does), tensors on the CPU in the file's order.
NamedTensors read_safetensors(const std::string& path);
SafetensorsContents read_safetensors_with_metadata(const std::string& path);

// Writes tensors (F32, F16 or BF16; moved to the CPU, made contiguous) with the header padded
// to a multiple of 8 bytes, as the reference implementation does. Names must be unique.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Copies dir/model.safetensors into `model`. Names with or without the "transformer." prefix
// are accepted; attention mask buffers are ignored; lm_head.weight must equal wte (the head is
// tied). F16/BF16 become float32. Shapes are checked; missing or unknown tensors are errors.
void load_pretrained(GPT2LMHeadModelImpl& model, const std::string& dir);

// A model built from dir/config.json with the weights of dir/model.safetensors.
GPT2LMHeadModel from_pretrained(const std::string& dir);

// Writes dir/config.json and dir/model.safetensors with Hugging Face names (the tied head
// once), creating dir; works on a parallelized model.
void save_pretrained(GPT2LMHeadModelImpl& model, const std::string& dir);

}  // namespace harness::model
