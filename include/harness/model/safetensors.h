// Hugging Face's safetensors format, read and written by a parser of our own that validates
// everything it reads, and loading/saving GPT-2 in Hugging Face's layout (config.json +
// model.safetensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "harness/model/gpt2.h"

namespace harness::model {

// One tensor of a file: its name, dtype and shape.
struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
};

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

// Writes a safetensors file one tensor at a time, so that tensors gathered one by one (a split
// model's unsplit weights) never have to be held all at once: the header for `entries` (F32, F16
// or BF16; names unique; padded to a multiple of 8 bytes, as the reference implementation does)
// is written first, then each append() writes the next entry's data (its dtype and shape are
// checked). The file is path + ".tmp" until finish() moves it into place; a writer destroyed
// before finish() removes it, so no half-written file is ever found under `path`.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                    const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void append(const torch::Tensor& tensor);
  void finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Writes tensors (F32, F16 or BF16; moved to the CPU, made contiguous) with the header padded
// to a multiple of 8 bytes, as the reference implementation does. Names must be unique.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// A safetensors file whose header is read and validated (as parse_safetensors does) when it is
// opened and whose tensors are read on demand: whole, or as ranges of their first or last
// dimension, reading only those bytes (a tensor-parallel rank's slices of a large tensor).
class SafetensorsReader {
 public:
  using TensorInfo = SafetensorsEntry;
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  const std::vector<TensorInfo>& tensors() const;  // in the file's order
  const std::map<std::string, std::string>& metadata() const;
  torch::Tensor read(const std::string& name);
  // The (start, length) ranges of dimension `dim` (0 or the last; 1- or 2-dimensional tensors),
  // concatenated along it in the order given.
  torch::Tensor read_ranges(const std::string& name, int64_t dim,
                            const std::vector<std::pair<int64_t, int64_t>>& ranges);
  uint64_t bytes_read() const;  // tensor data read so far

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Copies dir/model.safetensors into `model`. Names with or without the "transformer." prefix
// are accepted; attention mask buffers are ignored; lm_head.weight must equal wte (the head is
// tied). F16/BF16 become float32. Shapes are checked; missing or unknown tensors are errors.
// A model split over a tensor-parallel group reads the unsplit file, each rank its slices alone.
void load_pretrained(GPT2LMHeadModelImpl& model, const std::string& dir);

// A model built from dir/config.json with the weights of dir/model.safetensors.
GPT2LMHeadModel from_pretrained(const std::string& dir);

// Writes dir/config.json and dir/model.safetensors with Hugging Face names (the tied head
// once), creating dir; works on a parallelized model. Split over a tensor-parallel group it is a
// collective (every rank of the group calls it): the unsplit tensors are gathered one at a time
// and streamed into the file by the ranks that pass write = true (the same files as the unsplit
// model's), so no rank holds the unsplit model.
void save_pretrained(GPT2LMHeadModelImpl& model, const std::string& dir, bool write = true);
// Its model.safetensors alone, at `path`: the unsplit weights streamed one tensor at a time (a
// collective when the model is split; nothing happens where write is false and it is not).
void write_model_weights(GPT2LMHeadModelImpl& model, const std::string& path, bool write = true);

}  // namespace harness::model
