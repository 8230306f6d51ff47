// GPT-2 as a pipeline schedule program (see pipeline_train_step.h).
#include "harness/train/pipeline_train_step.h"

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <stdexcept>

#include "harness/model/loss.h"
#include "harness/pipeline/balance.h"
#include "harness/train/loss.h"

namespace harness::train {

pipeline::TrainingSchedule make_training_schedule(const std::string& name, int micro_batches,
                                                  int devices, int virtual_stages) {
  if (virtual_stages < 1) {
    throw std::invalid_argument("--virtual_stages must be >= 1, got " + std::to_string(virtual_stages));
  }
  if (name == "interleaved") {
    return micro_batches % devices == 0
               ? pipeline::interleaved_schedule(micro_batches, devices, virtual_stages)
               : pipeline::gpipe_schedule(micro_batches, devices, virtual_stages);
  }
  if (name != "gpipe" && name != "1f1b") {
    throw std::invalid_argument("--pipeline_schedule must be gpipe, 1f1b or interleaved, got '" + name + "'");
  }
  if (virtual_stages != 1) {
    throw std::invalid_argument("--virtual_stages " + std::to_string(virtual_stages) +
                                " needs --pipeline_schedule interleaved (got " + name +
                                "); gpipe and 1f1b run one stage per device");
  }
  return name == "gpipe" ? pipeline::gpipe_schedule(micro_batches, devices)
                         : pipeline::one_f_one_b_schedule(micro_batches, devices);
}

PipelineTrainStep::PipelineTrainStep(model::GPT2LMHeadModel gpt2, const OptimizerSettings& optimizer,
                                     PipelineStepOptions options)
    : GPT2TrainStep(std::move(gpt2), optimizer), options_(std::move(options)) {
  const int D = static_cast<int>(options_.devices.size());
  if (D < 1) throw std::invalid_argument("PipelineTrainStep: no devices given");
  if (options_.micro_batches < 1) {
    throw std::invalid_argument("--n_chunk must be >= 1, got " + std::to_string(options_.micro_batches));
  }
  // Checks the names and V now; interleaving's rule on M, for full batches, too.
  (void)make_training_schedule(options_.schedule, D, D, options_.virtual_stages);
  if (options_.schedule == "interleaved" && options_.micro_batches % D != 0) {
    throw std::invalid_argument("--pipeline_schedule interleaved needs --n_chunk to be a multiple of the " +
                                std::to_string(D) + " devices (Megatron's rule), got " +
                                std::to_string(options_.micro_batches));
  }
  const int S = D * options_.virtual_stages;
  const int n_layer = static_cast<int>(model()->config().n_layer);
  const std::string stages_from = std::to_string(D) + " devices x " +
                                  std::to_string(options_.virtual_stages) + " virtual stages";
  if (!options_.balance_halves.empty()) {
    halves_ = options_.balance_halves;
    pipeline::check_balance(halves_, 2 * n_layer, S, stages_from + ", in half blocks");
  } else {
    std::vector<int> blocks;
    if (options_.balance.empty()) {
      try {
        blocks = pipeline::default_balance(n_layer, S);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("the model's n_layer " + std::to_string(n_layer) + " blocks cannot fill " +
                                    std::to_string(S) + " stages (" + stages_from + "): " + e.what());
      }
    } else {
      blocks = options_.balance;
    }
    pipeline::check_balance(blocks, n_layer, S, stages_from);
    for (int b : blocks) halves_.push_back(2 * b);
  }

  std::vector<Device> attention_devices(static_cast<size_t>(n_layer)), mlp_devices(static_cast<size_t>(n_layer));
  first_unit_of_stage_.assign(1, 0);
  for (int s = 0, unit = 0; s < S; ++s) {
    for (int k = 0; k < halves_[s]; ++k, ++unit) {
      (unit % 2 == 0 ? attention_devices : mlp_devices)[static_cast<size_t>(unit / 2)] = options_.devices[s % D];
    }
    first_unit_of_stage_.push_back(first_unit_of_stage_.back() + halves_[s]);
  }
  model()->place(attention_devices, mlp_devices);

  pipeline::ExecutorOptions executor_options;
  executor_options.threads_per_device = options_.threads_per_device;
  executor_options.checkpointing = options_.checkpointing;
  executor_options.tracer = options_.tracer;
  executor_ = std::make_unique<pipeline::ScheduleExecutor>(options_.devices, executor_options);
}

PipelineTrainStep::~PipelineTrainStep() = default;

std::string PipelineTrainStep::balance_text() const { return pipeline::format_halves(halves_); }

c10::Device PipelineTrainStep::input_device() const { return options_.devices.front().torch_device(); }

double PipelineTrainStep::step(const std::vector<data::Batch>& batches) {
  const int D = static_cast<int>(options_.devices.size());
  const int S = stages();
  const c10::Device last_device = options_.devices[(S - 1) % D].torch_device();
  const at::Tensor weight_sum = combined_label_weight(batches, last_device);
  optimizer().zero_grad();
  model::GPT2LMHeadModelImpl& gpt2 = *model();
  // The tied head on the last stage: a leaf of its own with wte's values (sharing wte's storage
  // when the last stage's device holds wte, a copy otherwise) whose gradient is added to wte's
  // after the step, so each parameter's gradient accumulates on one worker only, in the
  // schedule's order: reproducible whatever the thread timing.
  at::Tensor& wte = gpt2.transformer->wte->weight;
  const at::Tensor head_weight = wte.detach().to(last_device).requires_grad_(wte.requires_grad());

  at::Tensor loss;
  const uint64_t step_seed = pipeline::step_stream_seed(options_.seed, global_step_);
  for (size_t k = 0; k < batches.size(); ++k) {
    const data::Batch& batch = batches[k];
    const int64_t rows = batch.input_ids.size(0);
    const int M = static_cast<int>(std::min<int64_t>(options_.micro_batches, rows));
    last_schedule_ = make_training_schedule(options_.schedule, M, D, options_.virtual_stages);
    if (last_schedule_.name != options_.schedule && !told_fallback_) {
      told_fallback_ = true;
      std::cerr << "run_pipeline: a batch of " << rows << " rows gives " << M
                << " micro-batches, not a multiple of the " << D
                << " devices interleaving needs; such batches run GPipe's order over the same stages"
                << std::endl;
    }
    const std::vector<at::Tensor> ids = batch.input_ids.to(input_device()).tensor_split(M, 0);
    const std::vector<at::Tensor> labels = batch.labels.to(last_device).tensor_split(M, 0);
    const std::vector<at::Tensor> weight_parts =
        batch.label_token_weights.to(last_device, torch::kFloat32).tensor_split(M, 0);
    const pipeline::StageForward forward = [&](int i, int s, const at::Tensor& input) {
      // On the stage's worker thread (autocast state is per thread), recomputation included.
      model::AutocastScope autocast(precision, options_.devices[s % D].torch_device().type());
      // GPT-2's own pieces: the embedding on the first stage, the stage's run of block halves, the
      // final norm, tied head and loss on the last.
      at::Tensor hidden = s == 0 ? gpt2.embed(ids[i]) : input;
      hidden = gpt2.forward_units(hidden, first_unit_of_stage_[s], first_unit_of_stage_[s + 1]);
      if (s < S - 1) return hidden;
      return model::weighted_cross_entropy(gpt2.head_logits(hidden, head_weight), labels[i], weight_parts[i],
                                           weight_sum);
    };
    // Micro-step k > 0 of an accumulated step draws from streams of its own.
    const uint64_t seed = k == 0 ? step_seed : pipeline::step_stream_seed(step_seed, static_cast<int64_t>(k));
    pipeline::StepResult result = executor_->run(last_schedule_, forward, seed);
    last_peak_in_flight_ = result.peak_in_flight;
    last_peak_held_bytes_ = result.peak_held_bytes;
    for (int i = 0; i < M; ++i) loss = loss.defined() ? loss + result.losses[i] : result.losses[i];
  }
  ++global_step_;

  if (head_weight.grad().defined()) {
    torch::NoGradGuard no_grad;
    const at::Tensor head_grad = head_weight.grad().to(wte.device());
    if (wte.grad().defined()) {
      wte.mutable_grad().add_(head_grad);
    } else {
      wte.mutable_grad() = head_grad.clone();
    }
  }
  if (after_backward) after_backward();
  optimizer().step();
  // Reading the loss also waits for the step, so a step's time is finished work on every device.
  return loss.item<double>();
}

}  // namespace harness::train
