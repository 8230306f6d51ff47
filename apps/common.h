// Flags that run_data_parallel and run_pipeline share. Parsing lives here, in the programs; the
// library (train/run/driver.h) takes plain structs.
#pragma once

#include <cxxopts.hpp>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "help.h"
#include "harness/data/dataset.h"
#include "harness/data/loader.h"
#include "harness/device.h"
#include "harness/train/run_data_parallel.h"
#include "harness/train/run_pipeline.h"

namespace harness::apps {

// Flags of both programs (SPEC §7); each program adds its own and the defaults that differ.
struct CommonFlags : train::RunConfig {
  std::string export_dataset;
};

inline void add_common_options(cxxopts::Options& options, int64_t default_batch_size,
                               int64_t default_epochs) {
  options.add_options()
      ("batch_size", "global batch, shared by the data-parallel ranks", cxxopts::value<int64_t>()->default_value(std::to_string(default_batch_size)), "N")
      ("n_epochs", "epochs", cxxopts::value<int64_t>()->default_value(std::to_string(default_epochs)), "N")
      ("learning_rate", "AdamW's learning rate; 0 leaves the weights as loaded", cxxopts::value<double>()->default_value("1e-4"), "LR")
      ("model_max_length", "tokens per example (source + target), longer ones cut", cxxopts::value<int64_t>()->default_value("128"), "N")
      ("dataset", "JSON Lines or fairseq folder (default: the embedded corpus)", cxxopts::value<std::string>()->default_value(""), "DIR")
      ("benchmark_only", "train only: no validation loss, generation or BLEU")
      ("max_batches", "batches per epoch; 0 = the whole epoch", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("precision", "fp32 | bf16: autocast precision of the training steps", cxxopts::value<std::string>()->default_value("fp32"), "P")
      ("gradient_accumulation_steps", "batches per optimizer step", cxxopts::value<int64_t>()->default_value("1"), "N")
      ("model", "preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-mini, gpt2-tiny", cxxopts::value<std::string>()->default_value("gpt2-mini"), "NAME")
      ("model_path", "Hugging Face folder to start from (default: none)", cxxopts::value<std::string>()->default_value(""), "DIR")
      ("dropout", "dropout of embeddings, attention and residuals (default: the model's)", cxxopts::value<double>(), "P")
      ("workdir", "where results, tokenizer and model are written", cxxopts::value<std::string>()->default_value("./workdir"), "DIR")
      ("seed", "fixes weights, shuffling, dropout and the embedded corpus", cxxopts::value<uint64_t>()->default_value("1234"), "N")
      ("devices", "cuda:0,cuda:1 or CPU lanes cpu:0,cpu:1 (default: every GPU, else two CPU lanes)", cxxopts::value<std::string>()->default_value(""), "LIST")
      ("threads_per_device", "intra-op threads of each CPU device; 0 = cores / devices", cxxopts::value<int>()->default_value("0"), "N")
      ("trace", "write a Chrome trace of the run to FILE (default: none)", cxxopts::value<std::string>()->default_value(""), "FILE")
      ("train_size", "training pairs taken from the dataset", cxxopts::value<size_t>()->default_value("5000"), "N")
      ("validation_size", "validation pairs", cxxopts::value<size_t>()->default_value("1000"), "N")
      ("test_size", "test pairs (generation and BLEU)", cxxopts::value<size_t>()->default_value("100"), "N")
      ("export_dataset", "write the corpus as JSON Lines to DIR and exit (default: none)", cxxopts::value<std::string>()->default_value(""), "DIR")
      ("fit_vocab", "a fresh model's vocabulary sized to the tokenizer's")
      ("checkpoint_every", "checkpoint every N optimizer steps; 0 = at each epoch's end only", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("checkpoint_dir", "where checkpoints go (default: <workdir>/checkpoints)", cxxopts::value<std::string>()->default_value(""), "DIR")
      ("keep_checkpoints", "complete checkpoints kept", cxxopts::value<int>()->default_value("2"), "K")
      ("resume", "none | auto (the newest complete checkpoint) | a checkpoint folder", cxxopts::value<std::string>()->default_value("none"), "WHAT")
      ("lr_schedule", "constant | cosine | linear, after --warmup_steps", cxxopts::value<std::string>()->default_value("constant"), "KIND")
      ("warmup_steps", "optimizer steps of linear warmup from 0", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("min_learning_rate", "the floor cosine and linear decay reach at the run's end", cxxopts::value<double>()->default_value("0"), "LR")
      ("weight_decay", "AdamW's decoupled weight decay", cxxopts::value<double>()->default_value("0.01"), "W")
      ("max_grad_norm", "clip by the global gradient norm; 0 = off", cxxopts::value<double>()->default_value("0"), "G")
      ("max_steps", "optimizer steps of the run; 0 = the epochs decide", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("eval_every", "validation loss every N optimizer steps; 0 = at epochs' ends only", cxxopts::value<int64_t>()->default_value("0"), "N")
      ("tensorboard_dir", "also write the metrics as TensorBoard events (default: none)", cxxopts::value<std::string>()->default_value(""), "DIR")
      ("async_checkpoint", "write checkpoints from a host snapshot in the background")
      ("no_progress", "no progress display on stderr");
}

inline CommonFlags read_common(const cxxopts::ParseResult& r) {
  CommonFlags f;
  f.batch_size = r["batch_size"].as<int64_t>();
  f.n_epochs = r["n_epochs"].as<int64_t>();
  f.learning_rate = r["learning_rate"].as<double>();
  f.model_max_length = r["model_max_length"].as<int64_t>();
  f.dataset = r["dataset"].as<std::string>();
  f.benchmark_only = r.count("benchmark_only") > 0;
  f.max_batches = r["max_batches"].as<int64_t>();
  f.gradient_accumulation_steps = r["gradient_accumulation_steps"].as<int64_t>();
  f.precision = model::parse_precision(r["precision"].as<std::string>());
  f.model.preset = r["model"].as<std::string>();
  f.model.path = r["model_path"].as<std::string>();
  if (r.count("dropout")) f.model.dropout = r["dropout"].as<double>();
  f.workdir = r["workdir"].as<std::string>();
  f.seed = r["seed"].as<uint64_t>();
  f.devices = r["devices"].as<std::string>();
  f.threads_per_device = r["threads_per_device"].as<int>();
  f.trace = r["trace"].as<std::string>();
  f.sizes.train = r["train_size"].as<size_t>();
  f.sizes.validation = r["validation_size"].as<size_t>();
  f.sizes.test = r["test_size"].as<size_t>();
  f.sizes_given[0] = r.count("train_size") > 0;
  f.sizes_given[1] = r.count("validation_size") > 0;
  f.sizes_given[2] = r.count("test_size") > 0;
  f.export_dataset = r["export_dataset"].as<std::string>();
  f.progress = r.count("no_progress") == 0;
  f.fit_vocab = r.count("fit_vocab") > 0;
  f.checkpoint.every = r["checkpoint_every"].as<int64_t>();
  f.checkpoint.dir = r["checkpoint_dir"].as<std::string>();
  f.checkpoint.keep = r["keep_checkpoints"].as<int>();
  f.checkpoint.resume = r["resume"].as<std::string>();
  f.controls.lr_schedule.kind = train::parse_lr_schedule(r["lr_schedule"].as<std::string>());
  f.controls.lr_schedule.warmup_steps = r["warmup_steps"].as<int64_t>();
  f.controls.lr_schedule.min_learning_rate = r["min_learning_rate"].as<double>();
  f.weight_decay = r["weight_decay"].as<double>();
  f.max_grad_norm = r["max_grad_norm"].as<double>();
  f.controls.max_steps = r["max_steps"].as<int64_t>();
  f.controls.eval_every = r["eval_every"].as<int64_t>();
  f.controls.tensorboard_dir = r["tensorboard_dir"].as<std::string>();
  f.controls.async_checkpoint = r.count("async_checkpoint") > 0;
  auto positive = [](const char* flag, int64_t value) {
    if (value <= 0) {
      throw std::invalid_argument(std::string("--") + flag + " must be positive, got " +
                                  std::to_string(value));
    }
  };
  positive("batch_size", f.batch_size);
  positive("n_epochs", f.n_epochs);
  positive("model_max_length", f.model_max_length);
  positive("gradient_accumulation_steps", f.gradient_accumulation_steps);
  if (f.max_batches < 0) throw std::invalid_argument("--max_batches must be >= 0");
  if (f.learning_rate < 0) throw std::invalid_argument("--learning_rate must be >= 0");
  if (f.threads_per_device < 0) throw std::invalid_argument("--threads_per_device must be >= 0");
  if (f.checkpoint.every < 0) {
    throw std::invalid_argument("--checkpoint_every must be >= 0, got " + std::to_string(f.checkpoint.every));
  }
  if (f.checkpoint.keep < 1) {
    throw std::invalid_argument("--keep_checkpoints must be at least 1, got " + std::to_string(f.checkpoint.keep));
  }
  if (f.checkpoint.resume.empty()) throw std::invalid_argument("--resume needs none, auto or a checkpoint folder");
  train::validate_lr_schedule(f.controls.lr_schedule, f.learning_rate);
  auto not_negative = [](const char* flag, double value) {
    if (!(value >= 0.0)) {
      throw std::invalid_argument(std::string("--") + flag + " must be >= 0, got " + train::format_number(value));
    }
  };
  not_negative("weight_decay", f.weight_decay);
  not_negative("max_grad_norm", f.max_grad_norm);
  not_negative("max_steps", static_cast<double>(f.controls.max_steps));
  not_negative("eval_every", static_cast<double>(f.controls.eval_every));
  if (f.sizes.train == 0 || f.sizes.validation == 0 || f.sizes.test == 0) {
    throw std::invalid_argument("--train_size, --validation_size and --test_size must be positive");
  }
  return f;
}

// The original's spelling of a boolean flag (argparse type=bool): "--pytest True" / "--pytest
// False" become "--pytest=true" / "--pytest=false"; a bare "--pytest" stays as it is.
inline std::vector<std::string> join_boolean_values(int argc, char** argv,
                                                    const std::vector<std::string>& flags) {
  std::vector<std::string> out(argv, argv + argc);
  for (size_t i = 1; i + 1 < out.size(); ++i) {
    const bool boolean_flag = std::find(flags.begin(), flags.end(), out[i]) != flags.end();
    const std::string& v = out[i + 1];
    if (boolean_flag && (v == "True" || v == "False" || v == "true" || v == "false" || v == "1" || v == "0")) {
      out[i] += "=" + std::string(v == "True" || v == "true" || v == "1" ? "true" : "false");
      out.erase(out.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    }
  }
  return out;
}

// `what`: the program's one sentence under the usage line of --help.
inline cxxopts::ParseResult parse_or_exit(cxxopts::Options& options, const std::string& what, int argc,
                                          char** argv) {
  options.add_options()("h,help", "this help");
  try {
    std::vector<std::string> joined = join_boolean_values(argc, argv, {"--pytest"});
    std::vector<char*> args;
    for (std::string& a : joined) args.push_back(a.data());
    cxxopts::ParseResult result = options.parse(static_cast<int>(args.size()), args.data());
    if (result.count("help")) {
      std::cout << one_line_help(options, what);
      std::exit(0);
    }
    if (!result.unmatched().empty()) {
      throw std::invalid_argument("unexpected argument '" + result.unmatched().front() + "'");
    }
    return result;
  } catch (const std::exception& e) {
    std::cerr << options.program() << ": " << e.what() << "\n(see --help)" << std::endl;
    std::exit(2);
  }
}

}  // namespace harness::apps
