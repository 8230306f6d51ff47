// --precision bf16: which ops run in which dtype under AutocastScope (recorded from the
// dispatcher with RecordFunction, by each op's output dtype), bf16 against fp32 on the tiny
// model, and the scope's thread-local, nestable state.
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "harness/model/dropout.h"
#include "harness/model/gpt2.h"
#include "harness/model/precision.h"
#include "harness/model/loss.h"

namespace harness::model {
namespace {

// Output dtypes seen per op name on this thread while a recorder is alive.
thread_local std::map<std::string, std::set<std::string>>* recorded = nullptr;

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) { return nullptr; }

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (recorded == nullptr) return;
  for (const c10::IValue& output : fn.outputs()) {
    if (output.isTensor() && output.toTensor().defined()) {
      (*recorded)[fn.name()].insert(c10::toString(output.toTensor().scalar_type()));
    }
  }
}

class OpDtypeRecorder {
 public:
  OpDtypeRecorder() {
    recorded = &ops_;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_start, on_end).needsOutputs(true).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpDtypeRecorder() {
    at::removeCallback(handle_);
    recorded = nullptr;
  }
  const std::map<std::string, std::set<std::string>>& ops() const { return ops_; }
  // The dtypes `op` produced; empty when it did not run.
  std::set<std::string> of(const std::string& op) const {
    auto it = ops_.find(op);
    return it == ops_.end() ? std::set<std::string>{} : it->second;
  }

 private:
  std::map<std::string, std::set<std::string>> ops_;
  at::CallbackHandle handle_;
};

GPT2Config tiny_config(double dropout) {
  GPT2Config config = GPT2Config::preset("gpt2-tiny");
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = dropout;
  return config;
}

struct Inputs {
  at::Tensor ids, labels, weights;
};

Inputs make_inputs(const GPT2Config& config) {
  torch::manual_seed(7);
  return {torch::randint(config.vocab_size, {3, 10}, torch::kLong),
          torch::randint(config.vocab_size, {3, 10}, torch::kLong), torch::ones({3, 10})};
}

const std::set<std::string> kBf16{"BFloat16"};
const std::set<std::string> kFp32{"Float"};

void expect_autocast_regions(const OpDtypeRecorder& recorder, const std::string& attention_op) {
  // The matmuls: every linear (c_attn, c_proj, c_fc, the head) and the attention in bf16.
  EXPECT_EQ(recorder.of("aten::linear"), kBf16);
  EXPECT_EQ(recorder.of(attention_op), kBf16) << attention_op;
  // Layer norm (ln_1, ln_2, ln_f) sees the fp32 residual stream: fp32 out.
  EXPECT_EQ(recorder.of("aten::layer_norm"), kFp32);
  // The loss: its log-sum-exp and the weighted sum in fp32, in the fused CPU cross entropy (which
  // takes fp32 logits only; torch's cross_entropy, its fallback, did not run).
  EXPECT_EQ(recorder.of("harness::weighted_token_cross_entropy"), kFp32);
  EXPECT_EQ(recorder.of("aten::cross_entropy_loss"), std::set<std::string>{});
  // The residual additions promote back to fp32, so nothing else downstream runs in bf16 by accident.
  EXPECT_EQ(recorder.of("aten::embedding"), kFp32);
}

TEST(Precision, ParseNamesTheFlag) {
  EXPECT_EQ(parse_precision("fp32"), Precision::kFp32);
  EXPECT_EQ(parse_precision("bf16"), Precision::kBf16);
  EXPECT_EQ(to_string(Precision::kBf16), "bf16");
  for (const std::string bad : {"fp16", "bfloat16", ""}) {
    try {
      parse_precision(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--precision"), std::string::npos) << e.what();
    }
  }
}

TEST(Precision, Bf16RunsMatmulsAndAttentionInBf16AndLayerNormSoftmaxAndLossInFp32) {
  const GPT2Config config = tiny_config(0.0);
  torch::manual_seed(1234);
  GPT2LMHeadModel model(config);
  model->train();
  const Inputs in = make_inputs(config);
  OpDtypeRecorder recorder;
  at::Tensor loss;
  {
    AutocastScope autocast(Precision::kBf16, c10::DeviceType::CPU);
    loss = weighted_cross_entropy(model->forward(in.ids), in.labels, in.weights);
  }
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  expect_autocast_regions(recorder, "aten::scaled_dot_product_attention");
  loss.backward();
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.value().scalar_type(), at::kFloat) << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_EQ(p.value().grad().scalar_type(), at::kFloat) << p.key();
  }
}

TEST(Precision, TheDropoutAttentionPathKeepsItsSoftmaxInFp32) {
  // With dropout on a CPU, with a dropout stream installed (pipeline workers on CPU lanes) or not,
  // attention is computed by attention_with_dropout: its matmuls in bf16, its softmax upcast to fp32.
  const GPT2Config config = tiny_config(0.1);
  torch::manual_seed(1234);
  GPT2LMHeadModel model(config);
  model->train();
  const Inputs in = make_inputs(config);
  for (const bool with_stream : {true, false}) {
    std::optional<DropoutGeneratorScope> stream;
    if (with_stream) stream.emplace(make_generator(c10::Device(c10::kCPU), 11));
    OpDtypeRecorder recorder;
    {
      AutocastScope autocast(Precision::kBf16, c10::DeviceType::CPU);
      weighted_cross_entropy(model->forward(in.ids), in.labels, in.weights);
    }
    EXPECT_EQ(recorder.of("aten::softmax"), kFp32) << with_stream;
    EXPECT_EQ(recorder.of("aten::baddbmm"), kBf16) << with_stream;  // the scores: mask bias + scale * q k^T
    EXPECT_EQ(recorder.of("aten::matmul"), kBf16) << with_stream;   // the probabilities times v
    EXPECT_TRUE(recorder.of("aten::scaled_dot_product_attention").empty()) << with_stream;
    EXPECT_EQ(recorder.of("aten::linear"), kBf16) << with_stream;
    EXPECT_EQ(recorder.of("aten::layer_norm"), kFp32) << with_stream;
  }
}

TEST(Precision, Bf16AgreesWithFp32WithinBf16sPrecisionOnTheTinyModel) {
  const GPT2Config config = tiny_config(0.0);
  const Inputs in = make_inputs(config);
  auto run = [&](Precision precision) {
    torch::manual_seed(1234);
    GPT2LMHeadModel model(config);
    at::Tensor loss;
    {
      AutocastScope autocast(precision, c10::DeviceType::CPU);
      loss = weighted_cross_entropy(model->forward(in.ids), in.labels, in.weights);
    }
    loss.backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : model->named_parameters()) grads[p.key()] = p.value().grad().clone();
    return std::make_pair(loss.item<double>(), grads);
  };
  const auto [fp32_loss, fp32_grads] = run(Precision::kFp32);
  const auto [bf16_loss, bf16_grads] = run(Precision::kBf16);
  // Stated tolerance: the loss within 1%, each weight matrix's gradient within 5% (relative norm)
  // and pointing the same way (cosine > 0.99); bf16 keeps 8 mantissa bits (relative 2^-8).
  EXPECT_NEAR(bf16_loss, fp32_loss, 1e-2 * fp32_loss);
  EXPECT_NE(bf16_loss, fp32_loss);  // autocast did change the arithmetic
  for (const auto& [name, g] : fp32_grads) {
    if (g.dim() < 2) continue;  // biases and norms: tiny, compared through the matrices they feed
    const at::Tensor b = bf16_grads.at(name);
    const double relative = ((b - g).norm() / g.norm()).item<double>();
    const double cosine = (b * g).sum().item<double>() / (b.norm() * g.norm()).item<double>();
    EXPECT_LT(relative, 5e-2) << name;
    EXPECT_GT(cosine, 0.99) << name;
  }
}

TEST(Precision, TheScopeIsThreadLocalNestsAndRestores) {
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  {
    AutocastScope outer(Precision::kBf16, c10::DeviceType::CPU);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
    EXPECT_EQ(at::autocast::get_autocast_dtype(c10::DeviceType::CPU), at::kBFloat16);
    bool other_thread = true;
    std::thread([&] { other_thread = at::autocast::is_autocast_enabled(c10::DeviceType::CPU); }).join();
    EXPECT_FALSE(other_thread);
    {
      AutocastScope fp32(Precision::kFp32, c10::DeviceType::CPU);  // does nothing
      EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
      AutocastScope inner(Precision::kBf16, c10::DeviceType::CPU);
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
}

}  // namespace
}  // namespace harness::model
