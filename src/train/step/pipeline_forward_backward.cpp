// GPT-2 as a pipeline schedule program, on threads or processes (see pipeline_forward_backward.h).
#include "harness/train/step/pipeline_forward_backward.h"

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <stdexcept>

#include "harness/pipeline/activation_meter.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/train/loss.h"
#include "harness/train/setup.h"
#include "harness/train/run/trainer.h"

namespace harness::train {

pipeline::TrainingSchedule make_training_schedule(pipeline::ScheduleKind kind, int micro_batches,
                                                  int devices, int virtual_stages,
                                                  const std::vector<pipeline::ActionTicks>& stage_ticks) {
  pipeline::check_schedule_kind(kind, virtual_stages);
  switch (kind) {
    case pipeline::ScheduleKind::kInterleaved:
      return micro_batches % devices == 0 ? pipeline::interleaved_schedule(micro_batches, devices, virtual_stages)
                                          : pipeline::gpipe_schedule(micro_batches, devices, virtual_stages);
    case pipeline::ScheduleKind::kGpipe: return pipeline::gpipe_schedule(micro_batches, devices);
    case pipeline::ScheduleKind::kOneFOneB: return pipeline::one_f_one_b_schedule(micro_batches, devices);
    case pipeline::ScheduleKind::kZb1p: return pipeline::zb1p_schedule(micro_batches, devices);
    case pipeline::ScheduleKind::kZbv: return pipeline::zbv_schedule(micro_batches, devices, stage_ticks);
  }
  throw std::invalid_argument("make_training_schedule: unknown schedule kind");
}

pipeline::TrainingSchedule gpt2_training_schedule(pipeline::ScheduleKind kind, int micro_batches, int devices,
                                                  int virtual_stages, const model::GPT2Config& config,
                                                  const std::vector<int>& halves, int64_t micro_rows, int64_t tokens) {
  // Only zbv's order depends on what each stage's F, B and W cost.
  const std::vector<pipeline::ActionTicks> stage_ticks =
      kind == pipeline::ScheduleKind::kZbv ? pipeline::estimate_gpt2_stage_ticks(config, halves, micro_rows, tokens)
                                           : std::vector<pipeline::ActionTicks>{};
  return make_training_schedule(kind, micro_batches, devices, virtual_stages, stage_ticks);
}

PipelineStepOptions pipeline_step_options(const PipelineScheduleConfig& flags, int devices) {
  PipelineStepOptions options;
  options.schedule = flags.schedule;
  options.virtual_stages = pipeline::chunks_per_device(flags.schedule, flags.virtual_stages);
  options.micro_batches = static_cast<int>(flags.n_chunk);
  options.checkpointing = flags.activation_checkpointing;
  pipeline::check_schedule_flags(flags.schedule, options.micro_batches, devices, flags.virtual_stages);
  options.balance_halves = flags.balance.halves_per_stage;
  return options;
}

PipelineStepOptions balanced_pipeline_options(const PipelineScheduleConfig& flags, int devices, bool processes,
                                              const model::GPT2Config& config, int64_t rows, int64_t tokens) {
  PipelineStepOptions options = pipeline_step_options(flags, devices);
  if (!options.balance_halves.empty()) return options;
  const int S = devices * options.virtual_stages;
  const int64_t micro_batch_rows = std::max<int64_t>(1, (rows + options.micro_batches - 1) / options.micro_batches);
  try {
    options.balance_halves =
        options.schedule == pipeline::ScheduleKind::kZbv
            ? pipeline::balance_gpt2_for_zbv(config, devices, options.micro_batches, micro_batch_rows, tokens)
            : pipeline::balance_gpt2_by_cost(config, S, micro_batch_rows, tokens);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(stages_from(devices, options.virtual_stages, processes) + " = " + std::to_string(S) +
                                " stages, but the model has " + std::to_string(2 * config.n_layer) +
                                " block halves (n_layer " + std::to_string(config.n_layer) + "): " + e.what());
  }
  return options;
}

pipeline::StageSplitFlags stage_split_flags(const PipelineStepOptions& options) {
  return {options.schedule, options.virtual_stages, options.micro_batches, options.balance, options.balance_halves};
}

std::string stages_from(int devices, int virtual_stages, bool processes) {
  return processes ? "--pipeline_parallel_size " + std::to_string(devices) + " x --virtual_stages " +
                         std::to_string(virtual_stages)
                   : std::to_string(devices) + " devices x " + std::to_string(virtual_stages) + " virtual stages";
}

PipelineForwardBackward::PipelineForwardBackward(model::GPT2LMHeadModel model, PipelineStepOptions options)
    : model_(std::move(model)), options_(std::move(options)) {
  const int D = static_cast<int>(options_.devices.size());
  if (D < 1) throw std::invalid_argument("PipelineForwardBackward: no devices given");
  cut_into_stages(D);
  const int S = stages();
  const int n_layer = static_cast<int>(model_->config().n_layer);
  std::vector<Device> attention_devices(static_cast<size_t>(n_layer)), mlp_devices(static_cast<size_t>(n_layer));
  for (int s = 0; s < S; ++s) {
    for (int64_t unit = first_unit_of_stage_[s]; unit < first_unit_of_stage_[s + 1]; ++unit) {
      (unit % 2 == 0 ? attention_devices : mlp_devices)[static_cast<size_t>(unit / 2)] =
          options_.devices[device_of_stage(s)];
    }
  }
  model_->place(attention_devices, mlp_devices);

  pipeline::ExecutorOptions executor_options;
  executor_options.threads_per_device = options_.threads_per_device;
  executor_options.checkpointing = options_.checkpointing;
  executor_options.tracer = options_.tracer;
  executor_ = std::make_unique<pipeline::ScheduleExecutor>(options_.devices, executor_options);
}

PipelineForwardBackward::PipelineForwardBackward(model::GPT2LMHeadModel model, PipelineStepOptions options,
                                                 PipelineProcesses processes)
    : model_(std::move(model)), options_(std::move(options)), processes_(std::move(processes)) {
  if (options_.devices.size() != 1) {
    throw std::invalid_argument("PipelineForwardBackward: a stage process runs on one device, got " +
                                std::to_string(options_.devices.size()));
  }
  const int P = processes_->pipeline.world_size;
  if (P < 2 || !processes_->pipeline.group) {
    throw std::invalid_argument("PipelineForwardBackward: stages as processes need a pipeline group of 2 or more, got " +
                                std::to_string(P));
  }
  cut_into_stages(P);
  const int p = processes_->pipeline.rank;
  if ((p == device_of_stage(0) || p == device_of_stage(stages() - 1)) != processes_->embedding.has_value()) {
    throw std::invalid_argument("PipelineForwardBackward: pipeline rank " + std::to_string(p) + " of " +
                                std::to_string(P) + (processes_->embedding ? " has" : " lacks") +
                                " an embedding group");
  }
  std::optional<pipeline::P2PDebugRecord> debug;
  if (processes_->debug_sync) debug = pipeline::P2PDebugRecord{processes_->pipeline.store};
  // Activations and their gradients alike: a micro-batch's hidden states, fp32 (the residual
  // stream stays fp32 under autocast).
  transport_ = std::make_unique<pipeline::ProcessTransport>(
      processes_->pipeline.group, options_.devices.front(),
      [this](const pipeline::P2PMessage& m) { return message_shape(m.micro_batch); }, at::kFloat, std::move(debug));
}

// [rows, T, C]; with sequence parallelism this tensor rank's part of it, split as the model splits
// it (rows where they divide by the tensor group, else positions).
std::vector<int64_t> PipelineForwardBackward::message_shape(int micro_batch) const {
  const int64_t rows = rows_.at(static_cast<size_t>(micro_batch));
  std::vector<int64_t> shape{rows, tokens_, model_->config().n_embd};
  const int64_t split = split_messages_ ? model_->sequence_split_of(rows, tokens_) : model::kWhole;
  if (split != model::kWhole) shape[static_cast<size_t>(split)] /= model_->tensor_parallel()->size();
  return shape;
}

PipelineForwardBackward::~PipelineForwardBackward() = default;

void PipelineForwardBackward::cut_into_stages(int D) {
  halves_ = pipeline::stage_halves(stage_split_flags(options_), static_cast<int>(model_->config().n_layer), D,
                                   stages_from(D, options_.virtual_stages, processes_.has_value()));
  first_unit_of_stage_.assign(1, 0);
  for (int h : halves_) first_unit_of_stage_.push_back(first_unit_of_stage_.back() + h);
}

std::string PipelineForwardBackward::balance_text() const { return pipeline::format_halves(halves_); }

int PipelineForwardBackward::schedule_devices() const {
  return processes_ ? processes_->pipeline.world_size : static_cast<int>(options_.devices.size());
}

int PipelineForwardBackward::device_of_stage(int s) const {
  return pipeline::device_of_stage(s, schedule_devices(), pipeline::placement_of(options_.schedule));
}

c10::Device PipelineForwardBackward::loss_device() const {
  if (processes_) return options_.devices.front().torch_device();
  return options_.devices[device_of_stage(stages() - 1)].torch_device();
}

int PipelineForwardBackward::owner_of(const std::string& name) const {
  return device_of_stage(pipeline::gpt2_stage_of_parameter(name, first_unit_of_stage_));
}

std::vector<std::string> PipelineForwardBackward::held_parameters() const {
  std::vector<std::string> names;
  for (const auto& item : model_->named_parameters()) {
    bool held = !processes_;
    for (int s = 0; s < stages() && !held; ++s) {
      held = device_of_stage(s) == processes_->pipeline.rank &&
             pipeline::stage_holds_gpt2_parameter(s, item.key(), first_unit_of_stage_);
    }
    if (held) names.push_back(item.key());
  }
  return names;
}

pipeline::ScheduleExecutor& PipelineForwardBackward::executor() {
  if (!executor_) throw std::logic_error("PipelineForwardBackward::executor: the stages are processes");
  return *executor_;
}

pipeline::TrainingSchedule PipelineForwardBackward::schedule_for(int64_t rows, int64_t tokens) {
  const int D = schedule_devices();
  const int M = static_cast<int>(std::min<int64_t>(options_.micro_batches, rows));
  // The same estimate on every stage, so the same order.
  pipeline::TrainingSchedule schedule = gpt2_training_schedule(options_.schedule, M, D, options_.virtual_stages,
                                                               model_->config(), halves_, (rows + M - 1) / M, tokens);
  if (options_.schedule == pipeline::ScheduleKind::kInterleaved && M % D != 0 && !told_fallback_) {
    told_fallback_ = true;
    std::cerr << "pipeline: a batch of " << rows << " rows gives " << M << " micro-batches, not a multiple of the "
              << D << " devices interleaving needs; such batches run GPipe's order over the same stages" << std::endl;
  }
  return schedule;
}

int64_t PipelineForwardBackward::gradient_accumulations(const data::Batch& batch) const {
  return std::min<int64_t>(options_.micro_batches, batch.input_ids.size(0));
}

at::Tensor PipelineForwardBackward::run(const data::Batch& batch, const at::Tensor& weight_sum_given, int64_t k,
                                        model::Precision precision) {
  const int S = stages();
  const c10::Device last_device = loss_device();
  const at::Tensor weight_sum =
      weight_sum_given.defined() ? weight_sum_given : combined_label_weight({batch}, last_device);
  model::GPT2LMHeadModelImpl& gpt2 = *model_;
  at::Tensor& wte = gpt2.transformer->wte->weight;
  if (k == 0) {
    // In-process, the tied head on the last stage is a leaf of its own with wte's values (sharing
    // wte's storage when the last stage's device holds wte, a copy otherwise) whose gradient is
    // added to wte's after the step, so each parameter's gradient accumulates on one worker only,
    // in the schedule's order: reproducible whatever the thread timing. A stage process uses its
    // own wte, which the last stage's rank holds for the head alone.
    head_weight_ = processes_ ? wte : wte.detach().to(last_device).requires_grad_(wte.requires_grad());
  }
  last_schedule_ = schedule_for(batch.input_ids.size(0), batch.input_ids.size(1));
  const int M = last_schedule_.micro_batches;
  const std::vector<at::Tensor> ids = batch.input_ids.to(input_device()).tensor_split(M, 0);
  const std::vector<at::Tensor> labels = batch.labels.to(last_device).tensor_split(M, 0);
  const std::vector<at::Tensor> weight_parts =
      batch.label_token_weights.to(last_device, torch::kFloat32).tensor_split(M, 0);
  const at::Tensor head_weight = head_weight_;
  const pipeline::StageForward forward = [&](int i, int s, const at::Tensor& input) {
    // On the stage's worker thread (autocast state is per thread), recomputation included.
    const c10::Device where = processes_ ? options_.devices.front().torch_device()
                                         : options_.devices[device_of_stage(s)].torch_device();
    model::AutocastScope autocast(precision, where.type());
    // With sequence parallelism every stage splits micro-batch i as the first stage's embedding does.
    if (gpt2.sequence_parallel()) gpt2.split_sequences_as(ids[i].size(0), ids[i].size(1));
    // GPT-2's own pieces: the embedding on the first stage, the stage's run of block halves, the
    // final norm, tied head and loss on the last.
    at::Tensor hidden = s == 0 ? gpt2.embed(ids[i]) : input;
    hidden = gpt2.forward_units(hidden, first_unit_of_stage_[s], first_unit_of_stage_[s + 1]);
    if (s < S - 1) return hidden;
    return gpt2.head_loss(hidden, labels[i], weight_parts[i], weight_sum, head_weight);
  };
  // Micro-step k > 0 of an accumulated step draws from streams of its own.
  const uint64_t step_seed = pipeline::step_stream_seed(options_.seed, global_step_);
  const uint64_t seed = k == 0 ? step_seed : pipeline::step_stream_seed(step_seed, k);

  std::vector<at::Tensor> losses;
  if (!processes_) {
    pipeline::StepResult result = executor_->run(last_schedule_, forward, seed);
    last_peak_in_flight_ = result.peak_in_flight;
    last_peak_held_bytes_ = result.peak_held_bytes;
    losses = std::move(result.losses);
  } else {
    split_messages_ = true;
    tokens_ = batch.input_ids.size(1);
    rows_.clear();
    for (const at::Tensor& part : ids) rows_.push_back(part.size(0));
    pipeline::ExecutorOptions executor_options;
    executor_options.checkpointing = options_.checkpointing;
    executor_options.tracer = options_.tracer;
    const int p = processes_->pipeline.rank;
    pipeline::DeviceStepResult part =
        pipeline::run_device_steps(pipeline::cached_p2p_plan(last_schedule_), p, options_.devices.front(), forward,
                                   seed, *transport_, executor_options, "stage " + std::to_string(p));
    last_peak_in_flight_ = {part.peak_in_flight};
    last_peak_held_bytes_.clear();
    if (pipeline::activation_meter_installed()) last_peak_held_bytes_ = {part.peak_held_bytes};
    losses = std::move(part.losses);
  }
  at::Tensor loss;
  for (const at::Tensor& l : losses) {
    if (l.defined()) loss = loss.defined() ? loss + l : l;
  }
  return loss;
}

void PipelineForwardBackward::set_tied_gradient(std::function<at::Tensor()> tied_gradient) {
  if (!processes_) throw std::logic_error("PipelineForwardBackward: a tied gradient's place is for stages that are processes");
  tied_gradient_ = std::move(tied_gradient);
}

void PipelineForwardBackward::finish_gradients() {
  ++global_step_;
  torch::NoGradGuard no_grad;
  at::Tensor& wte = model_->transformer->wte->weight;
  if (!processes_) {
    if (!head_weight_.defined() || !head_weight_.grad().defined()) return;
    const at::Tensor head_grad = head_weight_.grad().to(wte.device());
    if (wte.grad().defined()) {
      wte.mutable_grad().add_(head_grad);
    } else {
      wte.mutable_grad() = head_grad.clone();
    }
    head_weight_ = at::Tensor();
    return;
  }
  if (!processes_->embedding) return;
  // The embedding's gradient (first stage) and the head's (last stage), each already averaged over
  // its data-parallel group, summed: both copies of wte then take the same step.
  std::vector<at::Tensor> tensors;
  if (tied_gradient_) {
    tensors.push_back(tied_gradient_());
  } else {
    if (!wte.grad().defined()) wte.mutable_grad() = at::zeros_like(wte);
    tensors.push_back(wte.mutable_grad());
  }
  processes_->embedding->group->allreduce(tensors)->wait();
  head_weight_ = at::Tensor();
}

at::Tensor PipelineForwardBackward::from_last_stage(at::Tensor value) {
  std::vector<at::Tensor> tensors{value.reshape({1}).to(options_.devices.front().torch_device()).contiguous()};
  c10d::BroadcastOptions options;
  options.rootRank = device_of_stage(stages() - 1);
  processes_->pipeline.group->broadcast(tensors, options)->wait();
  return tensors.front().to(torch::kCPU);
}

double PipelineForwardBackward::step_loss(const at::Tensor& local) {
  if (!processes_) return local.item<double>();
  // The last stage computed it; every stage returns it (one float over the pipeline group).
  const bool last = processes_->pipeline.rank == device_of_stage(stages() - 1);
  return from_last_stage(last ? local.to(torch::kFloat64) : torch::zeros({1}, torch::kFloat64)).item<double>();
}

at::Tensor PipelineForwardBackward::forward_through_stages(const at::Tensor& ids, model::KVCache* cache) {
  model::GPT2LMHeadModelImpl& gpt2 = *model_;
  const int p = processes_->pipeline.rank, S = stages();
  using Message = pipeline::P2PMessage;
  // The training transport carries the one "micro-batch" of ids' rows down the chain.
  rows_ = {ids.size(0)};
  tokens_ = ids.size(1);
  // The cached path (generation) stays whole; with sequence parallelism a whole batch is split as
  // the first stage's embedding splits it.
  split_messages_ = cache == nullptr;
  if (split_messages_ && gpt2.sequence_parallel()) gpt2.split_sequences_as(ids.size(0), ids.size(1));
  at::Tensor hidden;
  for (int s = 0; s < S; ++s) {
    if (device_of_stage(s) != p) continue;
    if (s == 0) {
      const at::Tensor here = ids.to(options_.devices.front().torch_device());
      hidden = cache ? gpt2.embed_cached(here, *cache) : gpt2.embed(here);
    } else if (device_of_stage(s - 1) != p) {  // else the previous stage ran here: hidden is its output
      const Message input{Message::Kind::kActivation, 0, s - 1};
      transport_->exchange(p, {{pipeline::P2POp::Kind::kRecv, device_of_stage(s - 1), input}}, {});
      hidden = transport_->take(p, input);
    }
    hidden = gpt2.forward_units(hidden, first_unit_of_stage_[s], first_unit_of_stage_[s + 1], cache);
    if (s < S - 1 && device_of_stage(s + 1) != p) {
      transport_->exchange(p, {{pipeline::P2POp::Kind::kSend, device_of_stage(s + 1), {Message::Kind::kActivation, 0, s}}},
                           [&](const Message&) { return hidden; });
    }
  }
  transport_->finish(p);
  return p == device_of_stage(S - 1) ? hidden : at::Tensor();
}

std::optional<double> PipelineForwardBackward::validation_loss(data::BatchLoader& loader) {
  if (!processes_) return std::nullopt;
  model_->eval();
  const c10::Device device = options_.devices.front().torch_device();
  at::Tensor& wte = model_->transformer->wte->weight;
  // Every stage reads the same batches (the whole validation set); the last computes the loss.
  // With a context group the loader gives each rank its shard of every sequence, and the loss is
  // the whole sequences' (head_loss sums the shards').
  const BatchLoss loss = [&](const data::Batch& batch) {
    const at::Tensor hidden = forward_through_stages(batch.input_ids, nullptr);
    if (!hidden.defined()) return 0.0;
    return model_->head_loss(hidden, batch.labels.to(device), batch.label_token_weights.to(device), at::Tensor(), wte)
        .item<double>();
  };
  const double mean = evaluate_loss_with(loss, loader);
  return from_last_stage(torch::tensor({mean}, torch::kFloat64)).item<double>();
}

std::optional<std::vector<std::string>> PipelineForwardBackward::generate(
    const data::Tokenizer& tokenizer, const std::vector<data::TranslationExample>& examples,
    int64_t model_max_length, bool show_progress) {
  if (!processes_) return std::nullopt;
  check_positions(model_->config(), model_max_length);
  model_->eval();
  const int64_t vocabulary = tokenizer.vocab_size();
  at::Tensor& wte = model_->transformer->wte->weight;
  // Each new token goes down the stages once, each stage attending to its own layers' cache; the
  // last stage picks the next token and every stage learns it, so all of them stop together.
  const NextToken next = [&](const torch::Tensor& new_ids, model::KVCache& cache) {
    const at::Tensor hidden = forward_through_stages(new_ids, &cache);
    at::Tensor chosen = torch::zeros({1}, torch::kLong);
    if (hidden.defined()) {
      chosen = torch::tensor({model_->head_next_token(hidden, vocabulary, wte)}, torch::kLong);
    }
    return from_last_stage(chosen).item<int64_t>();
  };
  return generate_translations_with(next, tokenizer, examples, model_max_length, options_.devices.front().torch_device(),
                               show_progress);
}

}  // namespace harness::train
