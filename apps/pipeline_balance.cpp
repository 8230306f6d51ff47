// pipeline_balance: the pipelines' default split (GPT-2's pieces costed from their shapes) against
// --balance auto's (the same pieces timed on this machine), for each model asked: both splits,
// each stage's timed cost under both, and how much slower the default's slowest stage is than the
// timed split's. JSON on stdout, and to --out when given.
#include <cxxopts.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "help.h"
#include "model_preset.h"
#include "harness/host_memory.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/gpt2_pipeline.h"

namespace {

using namespace harness;
using nlohmann::ordered_json;

ordered_json piece_json(const pipeline::Gpt2PieceCosts& c) {
  return {{"embedding", c.embedding}, {"attention_half", c.attention}, {"mlp_half", c.mlp}, {"head_and_loss", c.head}};
}

ordered_json compare(const std::string& item, int stages, int64_t rows, int64_t tokens) {
  const model::GPT2Config config = apps::preset_with_vocabulary(item, "--models item '" + item + "'");
  torch::manual_seed(1234);
  model::GPT2LMHeadModel gpt2(config);
  const pipeline::Gpt2PieceCosts estimated = pipeline::estimate_gpt2_costs(config, rows, tokens);
  const pipeline::Gpt2PieceCosts timed = pipeline::time_gpt2_costs(gpt2, Device::cpu(0), rows, tokens);
  const std::vector<int> by_cost = pipeline::balance_gpt2(estimated, config.n_layer, stages);
  const std::vector<int> by_time = pipeline::balance_gpt2(timed, config.n_layer, stages);
  const std::vector<int> even = pipeline::even_balance(static_cast<int>(2 * config.n_layer), stages);
  // Each stage's timed seconds under a split, and the slowest of them.
  auto timed_stages = [&](const std::vector<int>& split) { return pipeline::gpt2_stage_costs(timed, split); };
  auto slowest = [](const std::vector<double>& seconds) { return *std::max_element(seconds.begin(), seconds.end()); };
  const std::vector<double> cost_split = timed_stages(by_cost), time_split = timed_stages(by_time),
                            even_split = timed_stages(even);
  const double slowest_cost = slowest(cost_split), slowest_time = slowest(time_split), slowest_even = slowest(even_split);
  // Blocks of the estimate and of the timing: what one block (both halves) costs, the unit.
  const double block_estimated = estimated.attention + estimated.mlp, block_timed = timed.attention + timed.mlp;
  return {{"model", item},
          {"n_layer", config.n_layer},
          {"n_embd", config.n_embd},
          {"vocab_size", config.vocab_size},
          {"head_in_blocks", {{"estimated", estimated.head / block_estimated}, {"timed", timed.head / block_timed}}},
          {"embedding_in_blocks",
           {{"estimated", estimated.embedding / block_estimated}, {"timed", timed.embedding / block_timed}}},
          {"estimated_costs", piece_json(estimated)},
          {"timed_seconds", piece_json(timed)},
          {"default_split", pipeline::format_halves(by_cost)},
          {"timed_split", pipeline::format_halves(by_time)},
          {"even_split", pipeline::format_halves(even)},
          {"timed_stage_seconds",
           {{"default_split", cost_split}, {"timed_split", time_split}, {"even_split", even_split}}},
          {"default_slowest_over_timed_slowest", slowest_cost / slowest_time},
          {"even_slowest_over_default_slowest", slowest_even / slowest_cost}};
}

}  // namespace

int main(int argc, char** argv) {
  keep_freed_host_memory();
  const std::string what =
      "The pipelines' default split of GPT-2 (costed from its shapes) against the timed one (--balance auto)";
  cxxopts::Options options("pipeline_balance", what);
  options.add_options()
      ("models", "comma-separated presets, each optionally :VOCAB", cxxopts::value<std::string>()->default_value("gpt2:1417,gpt2:50257,gpt2-mini:1417,gpt2-mini:4096"))
      ("stages", "pipeline stages", cxxopts::value<int>()->default_value("2"))
      ("rows", "rows per micro-batch", cxxopts::value<int64_t>()->default_value("8"))
      ("tokens", "tokens per row", cxxopts::value<int64_t>()->default_value("128"))
      ("threads", "intra-op threads", cxxopts::value<int>()->default_value("1"))
      ("out", "also write the JSON here", cxxopts::value<std::string>()->default_value(""))
      ("h,help", "this help");
  try {
    const cxxopts::ParseResult flags = options.parse(argc, argv);
    if (flags.count("help")) {
      std::cout << apps::one_line_help(options, what);
      return 0;
    }
    if (!flags.unmatched().empty()) throw std::invalid_argument("unexpected argument '" + flags.unmatched().front() + "'");
    at::set_num_threads(flags["threads"].as<int>());
    const int stages = flags["stages"].as<int>();
    const int64_t rows = flags["rows"].as<int64_t>(), tokens = flags["tokens"].as<int64_t>();
    ordered_json out = {{"device", "CPU, " + std::to_string(flags["threads"].as<int>()) + " intra-op thread(s)"},
                        {"stages", stages},
                        {"micro_batch", {{"rows", rows}, {"tokens", tokens}}},
                        {"element_cost_flops", pipeline::kGpt2ElementCost},
                        {"models", ordered_json::array()}};
    std::stringstream items(flags["models"].as<std::string>());
    for (std::string item; std::getline(items, item, ',');) {
      out["models"].push_back(compare(item, stages, rows, tokens));
      std::cerr << "pipeline_balance: " << item << " done" << std::endl;
    }
    const std::string text = out.dump(2);
    std::cout << text << std::endl;
    if (const std::string path = flags["out"].as<std::string>(); !path.empty()) {
      const std::string partial = path + ".partial";  // renamed into place once whole
      {
        std::ofstream file(partial);
        file << text << std::endl;
        if (!file) throw std::runtime_error("cannot write " + partial);
      }
      std::filesystem::rename(partial, path);
    }
  } catch (const std::exception& e) {
    std::cerr << "pipeline_balance: " << e.what() << std::endl;
    return 2;
  }
  return 0;
}
