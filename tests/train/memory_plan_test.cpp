// The memory plan against literal tables: parameter counts of the presets (and of built models,
// whole, tensor-parallel slices and pipeline stages), each ZeRO stage's bytes per rank, the
// activation estimate without and with a pipeline schedule, the printed plan and the refusal.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <regex>
#include <stdexcept>
#include <string>

#include "harness/model/gpt2.h"
#include "harness/model/tensor_parallel.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/train/plan/memory_plan.h"

namespace harness::train {
namespace {

using model::GPT2Config;

// Enough of a tensor-parallel group to construct rank `rank`'s slices (construction only asks
// for the rank and the size).
class ConstructionOnlyGroup final : public model::TensorParallelGroup {
 public:
  ConstructionOnlyGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  at::Tensor copy_to_region(const at::Tensor&) override { throw std::logic_error("not for training"); }
  at::Tensor reduce_from_region(const at::Tensor&) override { throw std::logic_error("not for training"); }
  std::vector<at::Tensor> all_gather(const at::Tensor&) override { throw std::logic_error("not for training"); }
  at::Tensor gather_sequence(const at::Tensor&, int64_t) override { throw std::logic_error("not for training"); }
  at::Tensor reduce_scatter_sequence(const at::Tensor&, int64_t) override {
    throw std::logic_error("not for training");
  }
  at::Tensor all_reduce(const at::Tensor&, ReduceOp) override { throw std::logic_error("not for training"); }
  at::Tensor run_in_rank_stream(const c10::Device&, const std::function<at::Tensor()>&) override {
    throw std::logic_error("not for training");
  }
  std::map<std::string, at::Tensor> rank_stream_states() const override { return {}; }
  void set_rank_stream_states(const std::map<std::string, at::Tensor>&) override {}

 private:
  int rank_, size_;
};

GPT2Config tiny_without_dropout() {
  GPT2Config c = GPT2Config::preset("gpt2-tiny");  // 2 layers, n_embd 64, 4 heads, 128 positions, vocab 1024
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = 0.0;
  return c;
}

MemoryPlanInput input_for(const GPT2Config& config, int D = 1) {
  MemoryPlanInput in;
  in.model_name = "test";
  in.config = config;
  in.plan.world_size = D;  // D data-parallel ranks
  in.rows_per_replica = 4;
  in.tokens = 40;
  return in;
}

TEST(MemoryPlan, ParameterCountsOfThePresetsAreHuggingFaces) {
  EXPECT_EQ(gpt2_parameter_count(GPT2Config::preset("gpt2")), 124439808);
  EXPECT_EQ(gpt2_parameter_count(GPT2Config::preset("gpt2-medium")), 354823168);
  EXPECT_EQ(gpt2_parameter_count(GPT2Config::preset("gpt2-large")), 774030080);
  EXPECT_EQ(gpt2_parameter_count(GPT2Config::preset("gpt2-xl")), 1557611200);
  EXPECT_EQ(gpt2_parameter_count(GPT2Config::preset("gpt2-tiny")), 173824);
}

TEST(MemoryPlan, ParameterCountsAreThoseOfBuiltModels) {
  const GPT2Config fixture = GPT2Config::from_json_file(std::string(HARNESS_FIXTURES_DIR) + "/gpt2_tiny/config.json");
  for (const GPT2Config& config : {GPT2Config::preset("gpt2-tiny"), GPT2Config::preset("gpt2-mini"), fixture}) {
    model::GPT2LMHeadModel built(config);
    EXPECT_EQ(gpt2_parameter_count(config), model::count_parameters(*built));
    EXPECT_EQ(plan_memory(input_for(config)).kinds.at(0).parameters, model::count_parameters(*built));
  }
}

TEST(MemoryPlan, ATensorParallelRankHoldsItsBuiltSlices) {
  const GPT2Config config = GPT2Config::preset("gpt2-tiny");
  MemoryPlanInput in = input_for(config, 2);
  in.plan.tensor_parallel_size = 2;
  in.plan.world_size = 4;
  const MemoryPlan plan = plan_memory(in);
  ASSERT_EQ(plan.kinds.size(), 1u);
  EXPECT_EQ(plan.kinds[0].who, "ranks 0-3");
  // wpe, the norms and c_proj biases whole; half of wte's 1024 rows (the tied head's vocabulary).
  EXPECT_EQ(plan.kinds[0].parameters, 91456);
  for (int rank : {0, 1}) {
    model::GPT2LMHeadModel built(config, std::make_shared<ConstructionOnlyGroup>(rank, 2));
    EXPECT_EQ(model::count_parameters(*built), 91456) << "rank " << rank;
  }
}

// What stage s of a built model holds, by the pipeline's own ownership rule.
int64_t built_stage_parameters(const GPT2Config& config, int stage, const std::vector<int64_t>& first_unit) {
  model::GPT2LMHeadModel built(config);
  int64_t n = 0;
  for (const auto& item : built->named_parameters()) {
    if (pipeline::stage_holds_gpt2_parameter(stage, item.key(), first_unit)) n += item.value().numel();
  }
  return n;
}

TEST(MemoryPlan, PipelineStagesHoldWhatTheirBuiltStagesOwn) {
  const GPT2Config config = GPT2Config::preset("gpt2-tiny");
  MemoryPlanInput in = input_for(config, 2);
  in.pipeline = true;
  in.pipeline_devices = 2;
  in.micro_batches = 2;
  //           default (one block each)          --balance 1.5,0.5 (a cut inside block 1)
  struct Row {
    std::vector<int> halves;
    int64_t stage0, stage1;
  };
  for (const Row& row : {Row{{}, 123712, 115648}, Row{{3, 1}, 140480, 98880}}) {
    in.balance_halves = row.halves;
    const MemoryPlan plan = plan_memory(in);
    ASSERT_EQ(plan.kinds.size(), 2u);
    EXPECT_EQ(plan.kinds[0].parameters, row.stage0);
    EXPECT_EQ(plan.kinds[1].parameters, row.stage1);  // ln_f and its own copy of the tied wte
    const std::vector<int64_t> first_unit = row.halves.empty() ? std::vector<int64_t>{0, 2, 4}
                                                               : std::vector<int64_t>{0, 3, 4};
    EXPECT_EQ(built_stage_parameters(config, 0, first_unit), row.stage0);
    EXPECT_EQ(built_stage_parameters(config, 1, first_unit), row.stage1);
    EXPECT_EQ(plan.kinds[0].who, "ranks 0-1");
    EXPECT_EQ(plan.kinds[1].who, "ranks 2-3");
  }
  in.balance_halves = {};
  EXPECT_EQ(plan_memory(in).kinds[0].holds, "stage 0: block halves 0-1, wte, wpe");
  EXPECT_EQ(plan_memory(in).kinds[1].holds, "stage 1: block halves 2-3, ln_f, wte (tied head)");
}

TEST(MemoryPlan, EachZeroStageSharesWhatTheTableSays) {
  // GPT-2 124M, psi = 124439808, bucket 25 MB = 26214400 bytes, the largest unit the embeddings
  // (50257 + 1024) x 768 = 39383808 parameters, two of them in flight at --zero_prefetch 1.
  struct Row {
    int D, stage;
    int64_t weights, gradients, optimizer;
  };
  const Row table[] = {
      {1, 0, 497759232, 497759232, 995518464},  //
      {2, 0, 497759232, 497759232, 995518464},  //
      {2, 1, 497759232, 497759232, 497759232},  // 8 psi / 2
      {4, 1, 497759232, 497759232, 248879616},  // 8 psi / 4
      {2, 2, 497759232, 275094016, 497759232},  // 4 psi / 2 + one bucket
      {4, 2, 497759232, 150654208, 248879616},  // 4 psi / 4 + one bucket
      {2, 3, 497759232, 497759232, 497759232},  // 4 psi / 2 + 4 x 2 units > 4 psi: all of it
      {4, 3, 439510272, 439510272, 248879616},  // 4 psi / 4 + 4 x 2 x 39383808
  };
  for (const Row& row : table) {
    MemoryPlanInput in = input_for(GPT2Config::preset("gpt2"), row.D);
    in.plan.zero.stage = row.stage;
    const RankMemory r = plan_memory(in).kinds.at(0);
    EXPECT_EQ(r.parameters, 124439808);
    EXPECT_EQ(r.weight_bytes, row.weights) << "D " << row.D << " stage " << row.stage;
    EXPECT_EQ(r.gradient_bytes, row.gradients) << "D " << row.D << " stage " << row.stage;
    EXPECT_EQ(r.optimizer_bytes, row.optimizer) << "D " << row.D << " stage " << row.stage;
  }
}

TEST(MemoryPlan, StagesOfAPipelineShardTheirOwnState) {
  // gpt2-tiny, data 2 x pipeline 2, ZeRO-1: each stage's AdamW halved over its 2 data-parallel ranks.
  MemoryPlanInput in = input_for(GPT2Config::preset("gpt2-tiny"), 2);
  in.pipeline = true;
  in.pipeline_devices = 2;
  in.plan.zero.stage = 1;
  const MemoryPlan plan = plan_memory(in);
  EXPECT_EQ(plan.kinds[0].weight_bytes, 494848);  // 4 x 123712
  EXPECT_EQ(plan.kinds[0].gradient_bytes, 494848);
  EXPECT_EQ(plan.kinds[0].optimizer_bytes, 494848);  // 8 x 61856
  EXPECT_EQ(plan.kinds[1].weight_bytes, 462592);     // 4 x 115648
  EXPECT_EQ(plan.kinds[1].optimizer_bytes, 462592);  // 8 x 57824
  EXPECT_EQ(plan.largest_model_state().who, "ranks 0-1");
  // ZeRO-3: a stage's chunks, and every unit of it gathered for the whole step (weights, and
  // gradients until the last micro-batch's backward).
  in.plan.zero.stage = 3;
  const MemoryPlan units = plan_memory(in);
  EXPECT_EQ(units.kinds[0].weight_bytes, 742272);     // 4 x 61856 + 4 x 123712
  EXPECT_EQ(units.kinds[0].gradient_bytes, 742272);
  EXPECT_EQ(units.kinds[0].optimizer_bytes, 494848);  // 8 x 61856
  EXPECT_EQ(units.kinds[1].weight_bytes, 693888);     // 4 x 57824 + 4 x 115648
}

TEST(MemoryPlan, ActivationsOfOneRankFollowTheShapes) {
  // Per token, without dropout: embeddings 4C = 256; attention 4C + 4C + 12C + 4C + 4 heads x 4 =
  // 1552; MLP 4C + 4C + 8I = 2560; head 4C + 4C + 8V = 8704: 17184 bytes, x 4 rows x 40 tokens.
  MemoryPlanInput in = input_for(tiny_without_dropout());
  EXPECT_EQ(plan_memory(in).kinds[0].activation_bytes, 2749440);
  in.bf16 = true;  // the matmuls' tensors in 2 bytes: 256 + 2 x (912 + 1408) + 8576 = 13472
  EXPECT_EQ(plan_memory(in).kinds[0].activation_bytes, 2155520);
  in.bf16 = false;
  in.config.attn_pdrop = 0.1;  // + (2 x 4 + 1) x 4 heads x 40 tokens - 16, per block
  EXPECT_EQ(plan_memory(in).kinds[0].activation_bytes, 2749440 + 160 * 2 * (9 * 4 * 40 - 16));
}

TEST(MemoryPlan, APipelineHoldsItsSchedulesMicroBatchesInFlight) {
  // 8 rows in 4 micro-batches of 2 x 40 tokens; stage 0 holds 4368 bytes a token (embeddings,
  // attention, MLP), stage 1 12816 (attention, MLP, head): 349440 and 1025280 per micro-batch.
  MemoryPlanInput in = input_for(tiny_without_dropout());
  in.rows_per_replica = 8;
  in.pipeline = true;
  in.pipeline_devices = 2;
  in.micro_batches = 4;
  struct Row {
    pipeline::ScheduleKind schedule;
    pipeline::ActivationCheckpointing checkpointing;
    int64_t device0, device1;
  };
  using AC = pipeline::ActivationCheckpointing;
  const Row table[] = {
      {pipeline::ScheduleKind::kOneFOneB, AC::kNever, 2 * 349440, 1025280},       // min(D - d, M) in flight
      {pipeline::ScheduleKind::kGpipe, AC::kNever, 4 * 349440, 4 * 1025280},  // all M
      // the stage inputs (ids: 8 bytes, hidden states: 4C) of all M, then one stage recomputed
      {pipeline::ScheduleKind::kGpipe, AC::kAlways, 4 * 640 + 349440, 4 * 20480 + 1025280},
      // ZB-H1: held until the W; device 1 lets one W wait, so it holds two like device 0
      {pipeline::ScheduleKind::kZb1p, AC::kNever, 2 * 349440, 2 * 1025280},
      // checkpointed: a recomputed stage stays whole until its W (device 1: F1's input arrives
      // while B0's stage waits for W0, and B1 recomputes beside both)
      {pipeline::ScheduleKind::kZb1p, AC::kAlways, 2 * 640 + 349440, 20480 + 2 * 1025280},
  };
  for (const Row& row : table) {
    in.schedule = row.schedule;
    in.checkpointing = row.checkpointing;
    const MemoryPlan plan = plan_memory(in);
    EXPECT_EQ(plan.kinds.at(0).activation_bytes, row.device0) << pipeline::to_string(row.schedule);
    EXPECT_EQ(plan.kinds.at(1).activation_bytes, row.device1) << pipeline::to_string(row.schedule);
  }
}

TEST(MemoryPlan, ThePrintedPlanHasARowPerKindAndTheAvailableFigure) {
  MemoryPlanInput in = input_for(GPT2Config::preset("gpt2-tiny"), 2);
  in.program = "run_data_parallel";
  const MemoryPlan plan = plan_memory(in);
  const std::string text = format_memory_plan(plan, {1000000000, "MemAvailable 2000000000 bytes / 2 ranks on this host"});
  EXPECT_NE(text.find("data 2 x tensor 1 x pipeline 1 = world 2"), std::string::npos) << text;
  EXPECT_TRUE(std::regex_search(text, std::regex(R"(\n  ranks +parameters +weights +gradients +optimizer +activations~ +total  holds\n  0-1 +173824 +695296 +695296 +1390592 +\d+ +\d+  whole model\n)")))
      << text;
  EXPECT_NE(text.find("available per rank: 1000000000 bytes (953.67 MiB) (MemAvailable 2000000000 bytes / 2 ranks on this host)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("model state per rank: at most 2781184 bytes (2.65 MiB) (ranks 0-1): fits"), std::string::npos)
      << text;
  EXPECT_NE(memory_plan_line(plan, {1000000000, "test"}).find("model state 2781184 bytes"), std::string::npos);
}

TEST(MemoryPlan, AModelStateThatDoesNotFitIsRefusedNamingTheStageThatWould) {
  const MemoryPlan plan = plan_memory(input_for(GPT2Config::preset("gpt2"), 4));  // 16 psi = 1991036928 bytes
  auto can_run_all = [](int) { return std::string(); };
  EXPECT_NO_THROW(check_model_state_fits(plan, {1991036928, "test"}, can_run_all));
  try {
    check_model_state_fits(plan, {1300000000, "MemAvailable 5200000000 bytes / 4 ranks on this host"},
                           [](int stage) { return stage >= 2 ? std::string("not in this build") : std::string(); });
    FAIL() << "not refused";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the model state needs 1991036928 bytes (1.85 GiB) per rank on ranks 0-3"), std::string::npos) << m;
    EXPECT_NE(m.find("but 1300000000 bytes (1.21 GiB) are available per rank (MemAvailable 5200000000 bytes / 4 ranks"),
              std::string::npos)
        << m;
    // ZeRO-1: 4 psi + 4 psi + 8 psi / 4 = 1244398080 bytes
    EXPECT_NE(m.find("--zero_stage 1 would need 1244398080 bytes per rank and fit"), std::string::npos) << m;
    EXPECT_EQ(m.find("cannot run it"), std::string::npos) << m;
  }
  try {  // only ZeRO-2 fits (4 psi + 4 psi / 4 + bucket + 8 psi / 4 = 897293056), and this build has none
    check_model_state_fits(plan, {1000000000, "test"},
                           [](int stage) { return stage >= 2 ? std::string("not in this build") : std::string(); });
    FAIL() << "not refused";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--zero_stage 2 would need 897293056 bytes per rank and fit, but this build cannot run it here: "
                     "not in this build"),
              std::string::npos)
        << m;
  }
  try {  // one replica: no stage shards anything
    check_model_state_fits(plan_memory(input_for(GPT2Config::preset("gpt2"), 1)), {1000, "test"}, can_run_all);
    FAIL() << "not refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no ZeRO stage fits: --zero_stage 3 would still need 1991036928 bytes per rank "
                                         "over 1 data-parallel rank"),
              std::string::npos)
        << e.what();
  }
}

TEST(MemoryPlan, LayoutsTheModelCannotTakeAreRefusedNamingTheValues) {
  MemoryPlanInput in = input_for(GPT2Config::preset("gpt2-tiny"));
  in.plan.tensor_parallel_size = 3;  // 4 heads
  in.plan.world_size = 3;
  EXPECT_THROW(plan_memory(in), std::invalid_argument);
  in.plan.tensor_parallel_size = 1;
  in.plan.world_size = 1;
  in.pipeline = true;
  in.pipeline_devices = 2;
  in.balance_halves = {2, 4};  // 6 halves, the model has 4
  try {
    plan_memory(in);
    FAIL() << "not refused";
  } catch (const std::invalid_argument& e) {
    // Named as the flag gives it, in blocks (1,2), not in the halves it holds (2,4).
    EXPECT_NE(std::string(e.what()).find("--balance 1,2 sums to 3 but the model has 2 blocks"), std::string::npos)
        << e.what();
  }
}

TEST(MemoryPlan, TheTestHookSetsTheAvailableFigure) {
  ::setenv("HARNESS_TEST_AVAILABLE_MEMORY_BYTES", "12345", 1);
  const AvailableMemory hooked = available_memory({Device::cpu(0), Device::cpu(1)});
  ::unsetenv("HARNESS_TEST_AVAILABLE_MEMORY_BYTES");
  EXPECT_EQ(hooked.bytes_per_rank, 12345);
  EXPECT_NE(hooked.how.find("test hook"), std::string::npos);
  const AvailableMemory host = available_memory({Device::cpu(0), Device::cpu(1)});
  EXPECT_GT(host.bytes_per_rank, 0);
  EXPECT_NE(host.how.find("MemAvailable"), std::string::npos) << host.how;
  EXPECT_NE(host.how.find("/ 2 ranks on this host"), std::string::npos) << host.how;
}

}  // namespace
}  // namespace harness::train
