// The model of a step's time on literal tables: bytes per collective, FLOPs per block against
// 6 N tokens plus attention, machine files, and predictions priced on a toy machine whose figures
// make the arithmetic checkable by hand.
#include "harness/train/plan/cost_model.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace harness::train {
namespace {

using nlohmann::json;

TEST(CostModel, BytesPerCollectiveFollowTheRingAlgorithms) {
  struct Row {
    Collective collective;
    int ranks;
    double bytes;
  };
  // 1000 bytes of payload: ring all-reduce 2 (n - 1) / n, all-gather and reduce-scatter (n - 1) / n.
  for (const Row& row : {Row{Collective::kAllReduce, 8, 1750.0}, Row{Collective::kAllReduce, 2, 1000.0},
                         Row{Collective::kAllGather, 4, 750.0}, Row{Collective::kReduceScatter, 4, 750.0},
                         Row{Collective::kSendRecv, 2, 1000.0}, Row{Collective::kAllReduce, 1, 0.0}}) {
    EXPECT_DOUBLE_EQ(collective_bytes(row.collective, 1000.0, row.ranks), row.bytes) << row.ranks;
  }
  const Link link{1000.0, 0.5};  // 1000 bytes/s, half a second a message
  EXPECT_DOUBLE_EQ(collective_seconds(Collective::kAllReduce, 1000.0, 4, link), 6 * 0.5 + 1.5);
  EXPECT_DOUBLE_EQ(collective_seconds(Collective::kAllGather, 1000.0, 4, link), 3 * 0.5 + 0.75);
  EXPECT_DOUBLE_EQ(collective_seconds(Collective::kSendRecv, 1000.0, 2, link), 0.5 + 1.0);
  EXPECT_DOUBLE_EQ(collective_seconds(Collective::kAllReduce, 1000.0, 1, link), 0.0);
}

TEST(CostModel, FlopsPerBlockAreSixNTokensPlusTheAttention) {
  const model::GPT2Config gpt2 = model::GPT2Config::preset("gpt2");  // C = 768, 12 layers, V = 50257
  const double C = 768.0, N = 12.0 * C * C;                           // a block's matmul parameters
  EXPECT_DOUBLE_EQ(block_training_flops(gpt2, 1.0, 128), 6.0 * N + 6.0 * C * 128);
  EXPECT_DOUBLE_EQ(block_training_flops(gpt2, 1.0, 128), 43057152.0);
  EXPECT_DOUBLE_EQ(block_training_flops(gpt2, 4096.0, 1024), 4096.0 * (6.0 * N + 6.0 * C * 1024));
  // The whole model: the blocks and the tied head's logits (6 C V a token).
  EXPECT_DOUBLE_EQ(model_training_flops(gpt2, 1.0, 128), 12 * 43057152.0 + 6.0 * C * 50257);
  EXPECT_DOUBLE_EQ(model_training_flops(gpt2, 1.0, 128), 748270080.0);
}

json toy_machine_json() {
  return {{"name", "toy"},
          {"devices_per_host", 2},
          {"fp32_flops", 1e12},
          {"bf16_flops", 2e12},
          {"matmul_efficiency", 0.5},
          {"memory_bytes_per_second", 1e11},
          {"memory_bytes", 1e9},
          {"inside_host", {{"bytes_per_second", 1e10}, {"latency_seconds", 1e-5}}},
          {"between_hosts", {{"bytes_per_second", 1e8}, {"latency_seconds", 1e-4}}},
          {"sources",
           {{"fp32_flops", "made up"}, {"bf16_flops", "made up"}, {"matmul_efficiency", "made up"},
            {"memory_bytes_per_second", "made up"}, {"memory_bytes", "made up"}, {"inside_host", "made up"},
            {"between_hosts", "made up"}}}};
}

TEST(CostModel, MachineFilesAreStrictAndEveryFigureHasASource) {
  const Machine m = machine_from_json(toy_machine_json(), "toy.json");
  EXPECT_EQ(m.devices_per_host, 2);
  EXPECT_DOUBLE_EQ(m.between_hosts.bytes_per_second, 1e8);
  EXPECT_EQ(machine_from_json(machine_to_json(m), "again").name, "toy");
  auto refused = [](const std::function<void(json&)>& damage, const std::string& needle) {
    json j = toy_machine_json();
    damage(j);
    try {
      (void)machine_from_json(j, "toy.json");
      ADD_FAILURE() << "accepted; expected " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([](json& j) { j["sources"].erase("bf16_flops"); }, "toy.json: field 'sources' gives no source for 'bf16_flops'");
  refused([](json& j) { j["matmul_efficiency"] = 1.5; }, "'matmul_efficiency' must be at most 1");
  refused([](json& j) { j["fp32_flops"] = -1; }, "field 'fp32_flops' must be a number > 0");
  refused([](json& j) { j.erase("inside_host"); }, "field 'inside_host' must be an object");
  for (const char* shipped : {"a100-80gb-sxm-x8.json", "h100-80gb-sxm-x8.json"}) {
    const Machine file = read_machine(std::string(HARNESS_SOURCE_DIR) + "/machines/" + shipped);
    EXPECT_GT(file.bf16_flops, file.fp32_flops) << shipped;
    EXPECT_EQ(file.devices_per_host, 8) << shipped;
  }
}

PlanQuestion toy_question() {
  PlanQuestion q;
  q.config = model::GPT2Config::preset("gpt2-tiny");
  q.model_name = "gpt2-tiny";
  q.batch_size = 8;
  q.sequence_length = 40;
  q.machine = machine_from_json(toy_machine_json(), "toy.json");
  return q;
}

Plan data_parallel(int world) {
  Plan plan;
  plan.world_size = world;
  return plan;
}

TEST(CostModel, AStepIsItsPartsAndDataParallelismHasNoBubble) {
  const PlanQuestion q = toy_question();
  const StepPrediction one = predict_step(q, data_parallel(1));
  EXPECT_GT(one.compute_seconds, 0.0);
  EXPECT_EQ(one.exposed_comm_seconds, 0.0);  // nothing to average
  EXPECT_EQ(one.bubble_seconds, 0.0);
  EXPECT_DOUBLE_EQ(one.step_seconds, one.compute_seconds + one.optimizer_seconds);
  EXPECT_DOUBLE_EQ(one.tokens_per_second, 8 * 40 / one.step_seconds);
  // AdamW over gpt2-tiny's 173824 parameters: 7 reads and writes of 4 bytes each at 1e11 bytes/s.
  EXPECT_NEAR(one.optimizer_seconds, 173824 * 28 / 1e11, 1e-12);
  // Two replicas inside a host: half the rows each, and an all-reduce of the gradients, of which
  // the backward hides all but its last bucket (the model's 695296 bytes are one bucket).
  const StepPrediction two = predict_step(q, data_parallel(2));
  EXPECT_NEAR(two.compute_seconds, one.compute_seconds / 2, one.compute_seconds * 0.05);
  EXPECT_NEAR(two.exposed_comm_seconds, 2 * 1e-5 + 695296 / 1e10, 1e-12);
  EXPECT_EQ(two.bubble_seconds, 0.0);
  // One device a host: the same all-reduce over the slow link.
  PlanQuestion apart = q;
  apart.nproc_per_node = 1;
  EXPECT_NEAR(predict_step(apart, data_parallel(2)).exposed_comm_seconds, 2 * 1e-4 + 695296 / 1e8, 1e-12);
}

TEST(CostModel, PipelinesArePricedOnTheirOwnSchedule) {
  const PlanQuestion q = toy_question();
  Plan plan = data_parallel(2);
  plan.pipeline_parallel_size = 2;
  plan.pipeline.n_chunk = 2;
  const StepPrediction one_f_one_b = predict_step(q, plan);
  EXPECT_GT(one_f_one_b.bubble_seconds, 0.0);
  plan.pipeline.n_chunk = 8;
  const StepPrediction more = predict_step(q, plan);
  EXPECT_LT(more.bubble_seconds / more.step_seconds, one_f_one_b.bubble_seconds / one_f_one_b.step_seconds);
  plan.pipeline.schedule = pipeline::ScheduleKind::kZb1p;
  EXPECT_LT(predict_step(q, plan).bubble_seconds, more.bubble_seconds);  // W fills the cool-down
  plan.pipeline.schedule = pipeline::ScheduleKind::kOneFOneB;
  plan.pipeline.activation_checkpointing = pipeline::ActivationCheckpointing::kAlways;
  const StepPrediction recomputed = predict_step(q, plan);
  EXPECT_GT(recomputed.compute_seconds, more.compute_seconds);
  EXPECT_LT(recomputed.memory_bytes_per_device, more.memory_bytes_per_device);
  plan.pipeline.n_chunk = 16;  // more micro-batches than a replica's 8 rows
  EXPECT_THROW(predict_step(q, plan), std::invalid_argument);
}

TEST(CostModel, LayoutsAreRankedFastestFirstThoseThatFitBeforeTheOthers) {
  PlanQuestion q = toy_question();
  const std::vector<StepPrediction> all = rank_layouts(q, 4);
  ASSERT_GT(all.size(), 20u);
  for (size_t i = 1; i < all.size(); ++i) {
    if (all[i].fits == all[i - 1].fits) {
      EXPECT_GE(all[i - 1].tokens_per_second, all[i].tokens_per_second);
    }
    EXPECT_FALSE(all[i].fits && !all[i - 1].fits);
  }
  q.machine.memory_bytes = 4'000'000;  // less than a replica's 2.78 MB of state and its activations
  const std::vector<StepPrediction> tight = rank_layouts(q, 4);
  EXPECT_TRUE(tight.front().fits);
  EXPECT_GT(tight.front().plan.zero.stage + tight.front().plan.tensor_parallel_size +
                tight.front().plan.pipeline_parallel_size,
            1);
  EXPECT_FALSE(tight.back().fits);
  EXPECT_NE(tight.back().why_not.find("against 4000000"), std::string::npos) << tight.back().why_not;
  const json out = predictions_to_json(q, 4, tight);
  EXPECT_EQ(out.at("world_size"), 4);
  for (const char* key : {"data", "context", "tensor", "pipeline", "sequence_parallel", "zero_stage", "schedule",
                          "n_chunk", "activation_checkpointing", "tokens_per_sec", "step_seconds", "compute_seconds",
                          "exposed_comm_seconds", "bubble_seconds", "optimizer_seconds", "memory_bytes_per_device",
                          "fits", "why_not", "mfu"}) {
    EXPECT_TRUE(out.at("layouts").at(0).contains(key)) << key;
  }
}

}  // namespace
}  // namespace harness::train
