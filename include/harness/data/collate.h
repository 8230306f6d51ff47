// Batches as SPEC §3 builds them: ids = encode(de + <eos_de>) ++ encode(en + <eos_en>), the mask
// 0 on the source and 1 on the target, both cut to model_max_length + 1 and right-padded with
// <pad> (mask 0); input_ids = ids[:, :-1], labels = ids[:, 1:], label_token_weights = mask[:, 1:].
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "harness/data/example.h"
#include "harness/data/tokenizer.h"

namespace harness::data {

struct Batch {
  at::Tensor input_ids;            // [B, T] int64
  at::Tensor labels;               // [B, T] int64
  at::Tensor label_token_weights;  // [B, T] float32
  std::vector<TranslationExample> examples;  // the pairs the rows came from, in order

  int64_t tokens() const;  // B * T of input_ids (SPEC §7's token count)
  // Copy to a device (pinned memory and non_blocking on CUDA).
  Batch to(const c10::Device& device) const;
};

Batch collate(const std::vector<TranslationExample>& examples, const Tokenizer& tokenizer,
              int64_t model_max_length);

}  // namespace harness::data
