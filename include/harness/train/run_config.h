// What both programs take (SPEC §7), as a plain struct the programs fill from their flags, and
// the driver's options it gives. run_pipeline.h and run_data_parallel.h add each program's own.
#pragma once

#include <cstdint>
#include <string>

#include "harness/data/dataset.h"
#include "harness/model/precision.h"
#include "harness/train/run/driver.h"
#include "harness/train/setup.h"

namespace harness::train {

// What both programs take (SPEC §7).
struct RunConfig {
  int64_t batch_size = 0;
  int64_t n_epochs = 0;
  double learning_rate = 1e-4;
  int64_t model_max_length = 128;
  std::string dataset;
  bool benchmark_only = false;
  int64_t max_batches = 0;
  int64_t gradient_accumulation_steps = 1;  // batches per optimizer step
  model::Precision precision = model::Precision::kFp32;  // --precision (model/precision.h)
  ModelSource model;
  std::string workdir = "./workdir";
  uint64_t seed = 1234;
  std::string devices;         // empty: the program's default
  int threads_per_device = 0;  // 0: cores / devices
  std::string trace;
  data::SplitSizes sizes;
  // Which of --train_size / --validation_size / --test_size were given: a --dataset split with
  // fewer pairs than a size given is an error; than a default size, all of it is used (said once).
  bool sizes_given[3] = {false, false, false};
  bool progress = true;
  bool fit_vocab = false;
  CheckpointOptions checkpoint;
  double weight_decay = 0.01;  // --weight_decay (AdamW's)
  double max_grad_norm = 0.0;  // --max_grad_norm: clip by the global gradient norm; 0: off
  TrainingControls controls;   // --lr_schedule, --warmup_steps, --min_learning_rate, --max_steps, --eval_every
  bool memory_plan = false;    // --memory_plan: print the per-rank memory plan (train/plan/memory_plan.h) and exit
  // The optimizer the programs build: AdamW at learning_rate with weight_decay, clipped at max_grad_norm.
  OptimizerSettings optimizer_settings() const {
    OptimizerSettings settings(learning_rate);
    settings.weight_decay = weight_decay;
    settings.max_grad_norm = max_grad_norm;
    return settings;
  }
};

// The driver's options that come from a RunConfig; each program adds its layout.
TrainingOptions training_options(const RunConfig& config, const std::string& program, ReportStyle style);

}  // namespace harness::train
