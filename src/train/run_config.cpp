// The driver's options a RunConfig gives (see run_config.h).
#include "harness/train/run_config.h"

namespace harness::train {

TrainingOptions training_options(const RunConfig& f, const std::string& program, ReportStyle style) {
  TrainingOptions o;
  o.program = program;
  o.style = style;
  o.n_epochs = f.n_epochs;
  o.max_batches = f.max_batches;
  o.gradient_accumulation_steps = f.gradient_accumulation_steps;
  o.global_batch_size = f.batch_size;
  o.model_max_length = f.model_max_length;
  o.benchmark_only = f.benchmark_only;
  o.show_progress = f.progress;
  o.seed = f.seed;
  o.workdir = f.workdir;
  o.checkpoint = f.checkpoint;
  o.learning_rate = f.learning_rate;
  o.controls = f.controls;
  return o;
}

}  // namespace harness::train
