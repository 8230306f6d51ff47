// The pipeline flags of both programs (SPEC §7.1, §7.2), declared and read in one place: the
// schedule, the activation checkpointing and the balance parsed here, each error naming its flag.
#pragma once

#include <string>

#include "common.h"

namespace harness::apps {

// `when`: where the program applies them ("in pipeline_parallel mode", ...).
inline void add_pipeline_options(cxxopts::Options& options, const std::string& when) {
  options.add_options()
      ("n_chunk", "micro-batches per batch, " + when, cxxopts::value<int64_t>()->default_value("4"), "M")
      ("pipeline_schedule", "gpipe | 1f1b | interleaved | zb1p | zbv, " + when, cxxopts::value<std::string>()->default_value("1f1b"), "NAME")
      ("virtual_stages", "stages per device under --pipeline_schedule interleaved (zbv: 2)", cxxopts::value<int>()->default_value("1"), "V")
      ("activation_checkpointing", "always | except_last | never: recompute forwards in backward", cxxopts::value<std::string>()->default_value("never"), "MODE")
      ("balance", "blocks per stage: auto (timed), or N,N,... with N.5 a half block (default: by GPT-2's costs)", cxxopts::value<std::string>()->default_value(""), "LIST");
}

inline train::PipelineScheduleConfig read_pipeline_flags(const cxxopts::ParseResult& result) {
  train::PipelineScheduleConfig c;
  c.n_chunk = result["n_chunk"].as<int64_t>();
  c.schedule = pipeline::parse_schedule_kind(result["pipeline_schedule"].as<std::string>());
  c.virtual_stages = result["virtual_stages"].as<int>();
  c.activation_checkpointing = pipeline::parse_activation_checkpointing(result["activation_checkpointing"].as<std::string>());
  c.balance = pipeline::parse_balance(result["balance"].as<std::string>());
  return c;
}

}  // namespace harness::apps
