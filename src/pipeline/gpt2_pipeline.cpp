// enable_pipeline: GPT-2 blocks as a pipelined Sequential.
#include "harness/pipeline/gpt2_pipeline.h"

#include <torch/torch.h>

#include <stdexcept>

#include "harness/pipeline/with_device.h"

namespace harness::pipeline {

std::shared_ptr<Pipe> enable_pipeline(model::GPT2LMHeadModel& model, const std::vector<Device>& devices,
                                      int64_t split_size, const PipeOptions& options) {
  if (model.is_empty()) throw std::invalid_argument("enable_pipeline: the model holder is empty");
  model->parallelize(devices);
  const auto& block_devices = model->block_devices();
  auto& blocks = model->transformer->h;
  if (blocks->size() != block_devices.size()) {
    throw std::logic_error("enable_pipeline: the model has " + std::to_string(blocks->size()) +
                           " blocks but parallelize placed " + std::to_string(block_devices.size()));
  }
  torch::nn::Sequential sequential;
  for (size_t i = 0; i < blocks->size(); ++i) {
    sequential->push_back(
        "h_" + std::to_string(i),
        WithDevice(model::GPT2Block(blocks->ptr<model::GPT2BlockImpl>(i)), block_devices[i]));
  }
  auto pipe = std::make_shared<Pipe>(sequential, split_size, options);
  std::weak_ptr<Pipe> weak = pipe;
  model->set_blocks_executor([weak](const torch::Tensor& hidden) {
    std::shared_ptr<Pipe> alive = weak.lock();
    if (!alive) {
      throw std::runtime_error(
          "GPT-2 blocks executor: the Pipe from enable_pipeline was destroyed; keep the returned "
          "pointer alive while the model runs, or call disable_pipeline(model)");
    }
    return alive->forward(hidden);
  });
  return pipe;
}

void disable_pipeline(model::GPT2LMHeadModel& model) { model->set_blocks_executor({}); }

}  // namespace harness::pipeline
