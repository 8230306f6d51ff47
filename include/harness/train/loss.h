// The label weight a training step divides its loss by (SPEC §3's loss is model/loss.h's).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

#include "harness/data/collate.h"

namespace harness::train {

// The label weight of all `batches` together (the weight_sum of model::weighted_cross_entropy for
// batches accumulated into one optimizer step), a float32 scalar on `device`. Throws
// std::invalid_argument when there is no batch or the weights sum to zero.
at::Tensor combined_label_weight(const std::vector<data::Batch>& batches, const c10::Device& device);

}  // namespace harness::train
