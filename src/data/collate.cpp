// SPEC §3's collate: source and target ids concatenated, the loss mask on the target, cut and
// right-padded to model_max_length + 1, then shifted into inputs and labels.
#include "harness/data/collate.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace harness::data {

int64_t Batch::tokens() const {
  if (!input_ids.defined()) return 0;
  return input_ids.numel();
}

Batch Batch::to(const c10::Device& device) const {
  Batch moved;
  moved.examples = examples;
  const bool to_cuda = device.is_cuda();
  auto move = [&](const at::Tensor& tensor) -> at::Tensor {
    if (!tensor.defined()) return tensor;
    if (to_cuda && tensor.is_cpu()) {
      at::Tensor pinned = tensor.is_pinned() ? tensor : tensor.pin_memory();
      return pinned.to(device, /*non_blocking=*/true);
    }
    return tensor.to(device);
  };
  moved.input_ids = move(input_ids);
  moved.labels = move(labels);
  moved.label_token_weights = move(label_token_weights);
  return moved;
}

Batch collate(const std::vector<TranslationExample>& examples, const Tokenizer& tokenizer,
              int64_t model_max_length) {
  if (examples.empty()) throw std::invalid_argument("collate: empty list of examples");
  if (model_max_length < 1) {
    throw std::invalid_argument("collate: model_max_length must be at least 1, got " +
                                std::to_string(model_max_length));
  }
  const int64_t batch_size = static_cast<int64_t>(examples.size());
  const int64_t length = model_max_length + 1;
  at::Tensor ids = torch::full({batch_size, length}, tokenizer.pad_id(), torch::kInt64);
  at::Tensor mask = torch::zeros({batch_size, length}, torch::kFloat32);
  auto ids_access = ids.accessor<int64_t, 2>();
  auto mask_access = mask.accessor<float, 2>();
  for (int64_t b = 0; b < batch_size; ++b) {
    const TranslationExample& example = examples[static_cast<size_t>(b)];
    const std::vector<int64_t> source = tokenizer.encode(example.de + Tokenizer::kEosDe);
    const std::vector<int64_t> target = tokenizer.encode(example.en + Tokenizer::kEosEn);
    int64_t t = 0;
    for (size_t i = 0; i < source.size() && t < length; ++i, ++t) ids_access[b][t] = source[i];
    for (size_t i = 0; i < target.size() && t < length; ++i, ++t) {
      ids_access[b][t] = target[i];
      mask_access[b][t] = 1.0f;
    }
  }
  Batch batch;
  using torch::indexing::Slice;
  batch.input_ids = ids.index({Slice(), Slice(0, length - 1)}).contiguous();
  batch.labels = ids.index({Slice(), Slice(1, length)}).contiguous();
  batch.label_token_weights = mask.index({Slice(), Slice(1, length)}).contiguous();
  batch.examples = examples;
  return batch;
}

}  // namespace harness::data
