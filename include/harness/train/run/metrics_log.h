// The run's metrics, step by step: <workdir>/metrics.jsonl, one JSON object a line, a "train"
// record per optimizer step and an "eval" record per evaluation, and optionally the same scalars
// Written by one process of the run (the driver decides which).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace harness::train {

class TensorBoardWriter;

struct StepMetrics {
  int64_t step = 0;   // optimizer steps taken, this one included (the first is 1)
  int64_t epoch = 0;  // the epoch it belongs to (0 for the first, as the printed lines count)
  double loss = 0.0;  // the step's training loss (this rank's batch)
  double learning_rate = 0.0;
  double grad_norm = 0.0;  // global, before clipping
  int64_t tokens = 0;      // B x T of input_ids over the step's batches (this rank's)
  double tokens_per_sec = 0.0;
  double step_time = 0.0;  // seconds
  int64_t peak_memory_bytes = 0;
};

struct EvalMetrics {
  int64_t step = 0;
  int64_t epoch = 0;
  double validation_loss = 0.0;
};

// An elastic membership change (train/elastic/elastic_trainer.h, SPEC §7.3): the generation it formed,
// the step it happened in, the replicas after it, and the processes (launch ranks) lost and joined.
struct MembershipRecord {
  int generation = 0;
  int64_t step = 0;
  int replicas = 0;
  std::vector<int> lost;
  std::vector<int> joined;
};

class MetricsLog {
 public:
  // Opens `path` for appending. A fresh run (resumed_step < 0) starts it empty; a resumed one
  // keeps the records up to its checkpoint's step and drops any later ones (written by the run
  // that was interrupted after that checkpoint), so that each step appears once.
  // `tensorboard_dir` (empty: none) receives every number as a TensorBoard scalar too, tagged
  // train/<field> and eval/validation_loss.
  MetricsLog(const std::string& path, int64_t resumed_step, const std::string& tensorboard_dir = "");
  ~MetricsLog();

  // One line each, flushed (a killed run keeps what it logged).
  void log(const StepMetrics& m);
  void log(const EvalMetrics& m);
  void log(const MembershipRecord& m);

 private:
  std::string path_;
  std::ofstream out_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

// The peak memory of this rank so far: the CUDA caching allocator's peak allocated bytes on
// `device` when it is a GPU, else the process's peak resident set size.
int64_t peak_memory_bytes(const c10::Device& device);

}  // namespace harness::train
