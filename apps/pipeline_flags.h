// The pipeline flags of both programs (SPEC §7.1, §7.2), declared and read in one place.
#pragma once

#include <string>

#include "common.h"

namespace harness::apps {

// `when`: where the program applies them ("pipeline_parallel mode", "--pipeline_parallel_size > 1").
inline void add_pipeline_options(cxxopts::Options& options, const std::string& when) {
  options.add_options()
      ("n_chunk", "micro-batches per batch (" + when + ")", cxxopts::value<int64_t>()->default_value("4"))
      ("pipeline_schedule", "gpipe | 1f1b | interleaved: the order of each stage's forwards and backwards (" + when + ")", cxxopts::value<std::string>()->default_value("1f1b"))
      ("virtual_stages", "stages per device (or per stage process) for --pipeline_schedule interleaved", cxxopts::value<int>()->default_value("1"))
      ("activation_checkpointing", "always | except_last | never: recompute a stage's forward in its backward instead of keeping its activations (torchgpipe's modes)", cxxopts::value<std::string>()->default_value("never"))
      ("balance", "blocks per stage: auto (timed, torchgpipe's balance_by_time, may cut a block between its attention and MLP halves) or N,N,... with N.5 for such a cut (default: runs of ceil(n_layer / stages))", cxxopts::value<std::string>()->default_value(""));
}

inline train::PipelineScheduleConfig read_pipeline_flags(const cxxopts::ParseResult& result) {
  train::PipelineScheduleConfig c;
  c.n_chunk = result["n_chunk"].as<int64_t>();
  c.schedule = result["pipeline_schedule"].as<std::string>();
  c.virtual_stages = result["virtual_stages"].as<int>();
  c.activation_checkpointing = result["activation_checkpointing"].as<std::string>();
  c.balance = result["balance"].as<std::string>();
  return c;
}

}  // namespace harness::apps
