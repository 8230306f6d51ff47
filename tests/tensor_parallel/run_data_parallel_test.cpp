// run_data_parallel --tensor_parallel_size end to end: two ranks splitting one model train to the
// same weights as one unsplit rank, and a world size that T does not divide is refused up front.
// Skipped when the program has not been built next to this test.
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "../support/after_adamw.h"
#include "harness/model/config.h"
#include "harness/model/safetensors.h"
#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

const std::string kProgram = std::string(HARNESS_BINARY_DIR) + "/run_data_parallel";

struct ProgramRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

ProgramRun run_program(const std::string& args) {
  ProgramRun run;
  const std::string command = kProgram + " " + args + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  std::array<char, 4096> buffer{};
  while (std::fgets(buffer.data(), static_cast<int>(buffer.size()), pipe) != nullptr) run.output += buffer.data();
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

std::string small_run_args(const std::string& workdir, bool evaluate = false) {
  return "--model gpt2-tiny --model_max_length 32 --dropout 0 --learning_rate 1e-3 --n_epochs 1 "
         "--max_batches 2 --batch_size 8 --train_size 64 --validation_size 16 --test_size 2 " +
         std::string(evaluate ? "" : "--benchmark_only ") + "--no_progress --workdir " + workdir +
         " --master_port " + std::to_string(testing::free_port());
}

// The number after `key` on the line that starts with `prefix`, or NaN.
double printed_value(const std::string& output, const std::string& prefix, const std::string& key) {
  const size_t line = output.find(prefix);
  if (line == std::string::npos) return std::nan("");
  const size_t at = output.find(key, line);
  return at == std::string::npos ? std::nan("") : std::stod(output.substr(at + key.size()));
}

size_t occurrences(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

// A name -> tensor dictionary written by --pytest (a .pth that torch.load reads).
std::map<std::string, at::Tensor> read_pth(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, at::Tensor> out;
  if (bytes.empty()) return out;
  for (const auto& entry : torch::pickle_load(bytes).toGenericDict()) {
    out[entry.key().toStringRef()] = entry.value().toTensor();
  }
  return out;
}

std::string file_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(RunDataParallelTensorParallel, TwoRanksSplittingTheModelTrainLikeOneUnsplitRank) {
  if (::access(kProgram.c_str(), X_OK) != 0) GTEST_SKIP() << kProgram << " is not built";
  const std::string dir = testing::make_temp_dir();
  ASSERT_FALSE(dir.empty());
  const ProgramRun single = run_program("--world_size 1 " + small_run_args(dir + "/single"));
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const ProgramRun split = run_program("--world_size 2 --tensor_parallel_size 2 " + small_run_args(dir + "/split"));
  ASSERT_EQ(split.exit_code, 0) << split.output;
  // One model replica, so one report: its tensor rank 0 prints the per-rank lines, as data-parallel
  // rank 0; the other rank of the tensor-parallel group prints none.
  EXPECT_EQ(occurrences(split.output, "Epoch 0 on Rank 0: Training Time = "), 1u) << split.output;
  EXPECT_EQ(occurrences(split.output, "Rank 0 training time: avg:"), 1u) << split.output;
  EXPECT_EQ(occurrences(split.output, "on Rank 1:"), 0u) << split.output;
  EXPECT_EQ(occurrences(split.output, "Rank 1 training time"), 0u) << split.output;
  EXPECT_NE(split.output.find("tensor_parallel_size=2 data_parallel_size=1"), std::string::npos) << split.output;
  // Rank 0 prints every rank's coordinates at start (tensor fastest, then data, then pipeline).
  // Rank 0 prints every rank's coordinates at start (tensor fastest, then data, then pipeline); the
  // launcher prefixes its lines with "[rank 0] ".
  for (const std::string line : {"layout: data 1 x tensor 2 x pipeline 1 = world 2, rank = (p*D + d)*T + t\n",
                                 "  rank  data  tensor  pipeline  reports\n", "     0     0       0         0  Rank 0\n",
                                 "     1     0       1         0  -\n"}) {
    EXPECT_NE(split.output.find(line), std::string::npos) << line << split.output;
  }
  // The first step's (unsplit) gradients, before AdamW, agree to rounding.
  const std::string pytest = " --pytest --grad_dir ";
  const ProgramRun single_grads = run_program("--world_size 1 " + small_run_args(dir + "/single_g") + pytest +
                                              dir + "/single_grads");
  ASSERT_EQ(single_grads.exit_code, 0) << single_grads.output;
  const ProgramRun split_grads = run_program("--world_size 2 --tensor_parallel_size 2 " +
                                             small_run_args(dir + "/split_g") + pytest + dir + "/split_grads");
  ASSERT_EQ(split_grads.exit_code, 0) << split_grads.output;
  const auto want_grads = read_pth(dir + "/single_grads/model0_gradients.pth");
  const auto got_grads = read_pth(dir + "/split_grads/model0_gradients.pth");
  ASSERT_EQ(got_grads.size(), want_grads.size());
  for (const auto& [name, g] : want_grads) {
    ASSERT_TRUE(got_grads.count(name)) << name;
    EXPECT_TRUE(test_support::gradients_agree(got_grads.at(name), g)) << name;
  }
  // The saved (unsplit, Hugging Face-named) weights after two AdamW steps of lr 1e-3 agree as
  // AdamW guarantees (tests/support/after_adamw.h): each tensor's difference within 1e-3 of the
  // steps' update, every element within what two steps can move it.
  std::map<std::string, at::Tensor> want, got;
  for (auto& [name, t] : model::read_safetensors(dir + "/single/model.safetensors")) want[name] = t;
  for (auto& [name, t] : model::read_safetensors(dir + "/split/model.safetensors")) got[name] = t;
  test_support::expect_weights_agree_after_adamw(got, want, model::GPT2Config::preset("gpt2-tiny").n_embd,
                                                 test_support::AdamWSteps{1e-3, 2}, 1e-3, "T=2 against T=1");
  testing::remove_tree(dir);
}

// Evaluation runs on the split model itself (no unsplit replica): the validation loss printed
// and the greedy, KV-cached translations written are the unsplit run's.
TEST(RunDataParallelTensorParallel, SplitModelEvaluatesAndGeneratesLikeOneUnsplitRank) {
  if (::access(kProgram.c_str(), X_OK) != 0) GTEST_SKIP() << kProgram << " is not built";
  const std::string dir = testing::make_temp_dir();
  ASSERT_FALSE(dir.empty());
  const ProgramRun single = run_program("--world_size 1 " + small_run_args(dir + "/single", true));
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const ProgramRun split =
      run_program("--world_size 2 --tensor_parallel_size 2 " + small_run_args(dir + "/split", true));
  ASSERT_EQ(split.exit_code, 0) << split.output;
  const double want = printed_value(single.output, "Epoch 0 on Rank 0: Validation Loss", "= ");
  ASSERT_FALSE(std::isnan(want)) << single.output;
  // Both ranks evaluate the split model together; the replica's report (tensor rank 0, as
  // data-parallel rank 0) prints the loss once and writes the one generations file.
  const double got = printed_value(split.output, "Epoch 0 on Rank 0: Validation Loss", "= ");
  EXPECT_NEAR(got, want, 1e-5 * std::abs(want)) << split.output;
  EXPECT_EQ(occurrences(split.output, "Validation Loss"), 1u) << split.output;
  const std::string generations = file_text(dir + "/split/rank0_gen_epoch0.json");
  EXPECT_FALSE(generations.empty());
  EXPECT_EQ(generations, file_text(dir + "/single/rank0_gen_epoch0.json"));
  EXPECT_NE(::access((dir + "/split/rank1_gen_epoch0.json").c_str(), F_OK), 0);
  EXPECT_NE(::access((dir + "/split/rank1_results_epoch0.json").c_str(), F_OK), 0);
  testing::remove_tree(dir);
}

// ZeRO-1 with tensor parallelism: each tensor-parallel rank shards AdamW's state of its slices
// over its data-parallel group. Two replicas of a model split in two train the weights of the same
// layout unsharded (only the order of sums differs: 1e-5 of the update, tests/support/after_adamw.h)
// and save the same unsplit model.
TEST(RunDataParallelTensorParallel, ZeroStageOneShardsEachSlicesStateOverItsDataParallelGroup) {
  if (::access(kProgram.c_str(), X_OK) != 0) GTEST_SKIP() << kProgram << " is not built";
  const std::string dir = testing::make_temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string layout = "--world_size 4 --tensor_parallel_size 2 ";
  const ProgramRun plain = run_program(layout + "--zero_stage 0 " + small_run_args(dir + "/plain"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const ProgramRun sharded = run_program(layout + "--zero_stage 1 " + small_run_args(dir + "/sharded"));
  ASSERT_EQ(sharded.exit_code, 0) << sharded.output;
  EXPECT_NE(sharded.output.find("--zero_stage 1 keeps"), std::string::npos) << sharded.output;
  std::map<std::string, at::Tensor> want, got;
  for (auto& [name, t] : model::read_safetensors(dir + "/plain/model.safetensors")) want[name] = t;
  for (auto& [name, t] : model::read_safetensors(dir + "/sharded/model.safetensors")) got[name] = t;
  test_support::expect_weights_agree_after_adamw(got, want, model::GPT2Config::preset("gpt2-tiny").n_embd,
                                                 test_support::AdamWSteps{1e-3, 2}, 1e-5,
                                                 "ZeRO-1 against replicated, D=2 x T=2");
  testing::remove_tree(dir);
}

TEST(RunDataParallelTensorParallel, WorldSizeNotDivisibleByTensorParallelSizeIsRefused) {
  if (::access(kProgram.c_str(), X_OK) != 0) GTEST_SKIP() << kProgram << " is not built";
  const ProgramRun run = run_program("--world_size 3 --tensor_parallel_size 2 " + small_run_args("/nonexistent/never-written"));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--world_size 3 is not divisible by --tensor_parallel_size 2"), std::string::npos)
      << run.output;
}

}  // namespace
}  // namespace harness::tensor_parallel
