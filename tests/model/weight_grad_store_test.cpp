// The split backward (zero-bubble's B and W): B under a WeightGradStore, then its flush, gives
// the joint backward's gradients bit for bit (one layer, the whole model, a pipeline stage, two
// accumulated micro-batches, bf16 autocast), and nothing is deferred without a store or grad mode.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness/model/config.h"
#include "harness/model/gpt2.h"
#include "harness/model/precision.h"
#include "harness/model/weight_grad_store.h"

namespace harness::model {
namespace {

constexpr const char* kWte = "transformer.wte.weight";

GPT2LMHeadModel tiny_model(int64_t vocab_size) {
  GPT2Config config = GPT2Config::preset("gpt2-tiny");
  config.vocab_size = vocab_size;
  config.bos_token_id = config.eos_token_id = vocab_size - 1;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  torch::manual_seed(5);
  return GPT2LMHeadModel(config);
}

struct MicroBatch {
  torch::Tensor ids, labels, weights;
};

std::vector<MicroBatch> micro_batches(const GPT2Config& config, int count) {
  torch::manual_seed(6);
  std::vector<MicroBatch> batches;
  for (int m = 0; m < count; ++m) {
    const torch::Tensor ids = torch::randint(config.vocab_size, {2, 9}, torch::kLong);
    batches.push_back({ids, ids.roll(1, 1), torch::rand({2, 9})});
  }
  return batches;
}

// The loss of `batch` with the linear layers' weight gradients deferred into `store` (B's graph).
torch::Tensor deferred_loss(GPT2LMHeadModel& model, const MicroBatch& batch, WeightGradStore& store) {
  DeferWeightGradients defer(&store);
  return model->loss(batch.ids, batch.labels, batch.weights);
}

// Every parameter's gradient (undefined where it has none), copied, then cleared.
std::map<std::string, torch::Tensor> take_gradients(torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> grads;
  for (auto& item : module.named_parameters()) {
    torch::Tensor& grad = item.value().mutable_grad();
    grads[item.key()] = grad.defined() ? grad.clone() : torch::Tensor();
    grad = torch::Tensor();
  }
  return grads;
}

// The gradients of the joint backward of `batch`'s loss (nothing deferred), taken off the model.
std::map<std::string, torch::Tensor> joint_gradients(GPT2LMHeadModel& model, const MicroBatch& batch) {
  model->loss(batch.ids, batch.labels, batch.weights).backward();
  return take_gradients(*model);
}

// Names whose gradients differ between `want` and `got` (in definedness or in any bit), except
// `except`.
std::vector<std::string> differing(const std::map<std::string, torch::Tensor>& want,
                                   const std::map<std::string, torch::Tensor>& got, const std::string& except = "") {
  std::vector<std::string> names;
  for (const auto& [name, grad] : want) {
    if (name == except) continue;
    const torch::Tensor& other = got.at(name);
    const bool same = grad.defined() ? other.defined() && torch::equal(grad, other) : !other.defined();
    if (!same) names.push_back(name);
  }
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

// A tensor-parallel group of one rank: every collective is the identity, so the row- and
// column-parallel Conv1D styles run their own code paths on the whole layer.
class SoloGroup : public TensorParallelGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  at::Tensor copy_to_region(const at::Tensor& x) override { return x; }
  at::Tensor reduce_from_region(const at::Tensor& x) override { return x; }
  std::vector<at::Tensor> all_gather(const at::Tensor& x) override { return {x}; }
  at::Tensor gather_sequence(const at::Tensor& x, int64_t) override { return x; }
  at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t) override { return x; }
  at::Tensor all_reduce(const at::Tensor& x, ReduceOp) override { return x.clone(); }
  at::Tensor run_in_rank_stream(const c10::Device&, const std::function<at::Tensor()>& fn) override { return fn(); }
  std::map<std::string, at::Tensor> rank_stream_states() const override { return {}; }
  void set_rank_stream_states(const std::map<std::string, at::Tensor>&) override {}
};

// One Conv1D of each style: the joint backward, then B (the weight's gradient still undefined,
// the bias's and the input's already final) and W, bit for bit.
TEST(SplitBackward, OneConv1DOfEachStyleMatchesTheJointBackward) {
  for (const ParallelStyle style : {ParallelStyle::kReplicated, ParallelStyle::kColumn, ParallelStyle::kRow}) {
    SCOPED_TRACE(static_cast<int>(style));
    torch::manual_seed(1);
    Conv1D layer(64, 192, style, std::make_shared<SoloGroup>());
    const torch::Tensor x = torch::randn({2, 5, 64}).requires_grad_(true);
    const torch::Tensor dy = torch::randn({2, 5, 192});
    layer->forward(x).backward(dy);
    const torch::Tensor want_x = x.grad().clone();
    const auto want = take_gradients(*layer);
    x.mutable_grad() = torch::Tensor();

    WeightGradStore store;
    {
      DeferWeightGradients defer(&store);
      layer->forward(x).backward(dy);
    }
    EXPECT_EQ(store.size(), 1u);
    EXPECT_FALSE(layer->weight.grad().defined());
    EXPECT_TRUE(torch::equal(layer->bias.grad(), want.at("bias")));
    EXPECT_TRUE(torch::equal(x.grad(), want_x));
    store.flush();
    EXPECT_TRUE(store.empty());
    EXPECT_TRUE(torch::equal(layer->weight.grad(), want.at("weight")));
  }
}

// The whole model's loss, with the tied head on the padded product (1017 ids) and on
// torch::linear (1024): B then W gives every gradient of the joint backward, wte's included
// (its embedding part in B, its head part in W, added in the other order: exact for two terms).
TEST(SplitBackward, TheWholeModelsLossMatchesTheJointBackward) {
  for (const int64_t vocab : {1017, 1024}) {
    SCOPED_TRACE(vocab);
    GPT2LMHeadModel model = tiny_model(vocab);
    const MicroBatch batch = micro_batches(model->config(), 1).front();
    const auto want = joint_gradients(model, batch);

    WeightGradStore store;
    deferred_loss(model, batch, store).backward();
    // Four Conv1Ds per block and the head.
    EXPECT_EQ(store.size(), 4u * model->config().n_layer + 1);
    // After B, only the Conv1Ds' weights (c_attn, c_fc, c_proj) are without a gradient; wte has
    // its embedding part.
    for (auto& item : model->named_parameters()) {
      const std::string& name = item.key();
      const bool conv1d_weight = name.find(".c_") != std::string::npos && name.substr(name.size() - 7) == ".weight";
      EXPECT_EQ(item.value().grad().defined(), !conv1d_weight) << name;
    }
    store.flush();
    const auto got = take_gradients(*model);
    EXPECT_EQ(differing(want, got), std::vector<std::string>{});
  }
}

// Two accumulated micro-batches, W after both B's and W after each B: every gradient is the two
// joint backwards', bit for bit, except wte's when the model holds both its uses (embedding in
// B, head in W: (e0 + h0) + (e1 + h1) becomes ((e0 + e1) + h0) + h1), which agrees within
// rounding, and exactly on the rows the second micro-batch does not embed. With the head on its
// own copy of wte (a pipeline's last stage) every gradient matches.
TEST(SplitBackward, TwoMicroBatchesAccumulateAsTwoJointBackwards) {
  for (const int64_t vocab : {1017, 1024}) {
    for (const bool head_copy : {false, true}) {
      SCOPED_TRACE(std::to_string(vocab) + (head_copy ? " head on a copy of wte" : " tied head"));
      GPT2LMHeadModel model = tiny_model(vocab);
      const torch::Tensor copy = model->transformer->wte->weight.detach().clone().requires_grad_(true);
      const auto batches = micro_batches(model->config(), 2);
      const torch::Tensor weight_sum = batches[0].weights.sum() + batches[1].weights.sum();
      auto loss = [&](const MicroBatch& b) {
        const torch::Tensor hidden = model->forward_units(model->embed(b.ids), 0, model->n_units());
        return model->head_loss(hidden, b.labels, b.weights, weight_sum, head_copy ? copy : torch::Tensor());
      };
      for (const MicroBatch& b : batches) loss(b).backward();
      auto want = take_gradients(*model);
      const torch::Tensor want_copy = head_copy ? copy.grad().clone() : torch::Tensor();
      copy.mutable_grad() = torch::Tensor();

      for (const bool w_after_each_b : {false, true}) {
        SCOPED_TRACE(w_after_each_b ? "B0 W0 B1 W1" : "B0 B1 W0 W1");
        std::vector<WeightGradStore> stores(2);
        for (size_t m = 0; m < 2; ++m) {
          torch::Tensor l;
          {
            DeferWeightGradients defer(&stores[m]);
            l = loss(batches[m]);
          }
          l.backward();
          if (w_after_each_b) stores[m].flush();
        }
        for (auto& store : stores) store.flush();
        const auto got = take_gradients(*model);
        if (head_copy) {
          EXPECT_EQ(differing(want, got), std::vector<std::string>{});
          EXPECT_TRUE(torch::equal(copy.grad(), want_copy));
          copy.mutable_grad() = torch::Tensor();
          continue;
        }
        EXPECT_EQ(joined(differing(want, got, kWte)), "");
        EXPECT_TRUE(torch::allclose(got.at(kWte), want.at(kWte), 1e-5, 1e-7));
        torch::Tensor untouched = torch::ones({vocab}, torch::kBool);
        untouched.index_put_({batches[1].ids.flatten()}, false);
        EXPECT_TRUE(torch::equal(got.at(kWte).index({untouched}), want.at(kWte).index({untouched})));
      }
    }
  }
}

// A pipeline stage: block halves [1, 4) on a received activation, backward from a received
// gradient: the activation's gradient (B's product, sent upstream) and every parameter's.
TEST(SplitBackward, AStageOfBlockHalvesMatchesTheJointBackward) {
  GPT2LMHeadModel model = tiny_model(1024);
  const MicroBatch batch = micro_batches(model->config(), 1).front();
  torch::Tensor received;
  {
    torch::NoGradGuard no_grad;
    received = model->embed(batch.ids);
  }
  received.requires_grad_(true);
  torch::manual_seed(7);
  const torch::Tensor output_grad = torch::randn({2, 9, model->config().n_embd});

  model->forward_units(received, 1, 4).backward(output_grad);
  const torch::Tensor want_input = received.grad().clone();
  const auto want = take_gradients(*model);
  received.mutable_grad() = torch::Tensor();

  WeightGradStore store;
  torch::Tensor out;
  {
    DeferWeightGradients defer(&store);
    out = model->forward_units(received, 1, 4);
  }
  out.backward(output_grad);
  EXPECT_TRUE(torch::equal(received.grad(), want_input));  // final after B
  EXPECT_EQ(store.size(), 6u);                              // c_fc, c_proj; c_attn, c_proj; c_fc, c_proj
  store.flush();
  EXPECT_EQ(differing(want, take_gradients(*model)), std::vector<std::string>{});
}

// Under bf16 autocast on the CPU the products run on bf16 operands and their gradients are cast
// back to fp32: B then W still gives every gradient of the joint backward, bit for bit.
TEST(SplitBackward, Bf16AutocastMatchesTheJointBackward) {
  GPT2LMHeadModel model = tiny_model(1024);
  const MicroBatch batch = micro_batches(model->config(), 1).front();
  {
    AutocastScope autocast(Precision::kBf16, torch::kCPU);
    model->loss(batch.ids, batch.labels, batch.weights).backward();
  }
  const auto want = take_gradients(*model);

  WeightGradStore store;
  {
    AutocastScope autocast(Precision::kBf16, torch::kCPU);
    deferred_loss(model, batch, store).backward();
  }
  EXPECT_EQ(store.size(), 4u * model->config().n_layer + 1);
  store.flush();
  const auto got = take_gradients(*model);
  EXPECT_EQ(got.at(kWte).scalar_type(), torch::kFloat);
  EXPECT_EQ(differing(want, got), std::vector<std::string>{});
}

// The store is read when the forward runs: a backward on another thread (as GPU autograd runs
// nodes on its device threads) still puts into it.
TEST(SplitBackward, TheBackwardMayRunOnAnotherThread) {
  GPT2LMHeadModel model = tiny_model(1017);
  const MicroBatch batch = micro_batches(model->config(), 1).front();
  const auto want = joint_gradients(model, batch);

  WeightGradStore store;
  const torch::Tensor loss = deferred_loss(model, batch, store);
  std::thread backward([&] { loss.backward(); });
  backward.join();
  EXPECT_EQ(store.size(), 4u * model->config().n_layer + 1);
  store.flush();
  EXPECT_EQ(differing(want, take_gradients(*model)), std::vector<std::string>{});
}

// Without a scope (or under DeferWeightGradients(nullptr)) nothing is deferred: the gradients
// are the joint backward's and the store stays empty; scopes nest and restore.
TEST(SplitBackward, WithoutAStoreNothingIsDeferred) {
  GPT2LMHeadModel model = tiny_model(1024);
  const MicroBatch batch = micro_batches(model->config(), 1).front();
  const auto want = joint_gradients(model, batch);

  WeightGradStore store;
  EXPECT_EQ(deferred_weight_gradients(), nullptr);
  {
    DeferWeightGradients defer(&store);
    EXPECT_EQ(deferred_weight_gradients(), &store);
    {
      DeferWeightGradients off(nullptr);
      EXPECT_EQ(deferred_weight_gradients(), nullptr);
      model->loss(batch.ids, batch.labels, batch.weights).backward();
    }
    EXPECT_EQ(deferred_weight_gradients(), &store);
  }
  EXPECT_EQ(deferred_weight_gradients(), nullptr);
  EXPECT_TRUE(store.empty());
  EXPECT_EQ(differing(want, take_gradients(*model)), std::vector<std::string>{});
  model->loss(batch.ids, batch.labels, batch.weights).backward();
  EXPECT_TRUE(store.empty());
  EXPECT_EQ(differing(want, take_gradients(*model)), std::vector<std::string>{});
}

// Under a no-grad guard there is no graph, hence nothing to defer and no hook; an input that
// does not require grad leaves the weight's gradient in the joint backward too.
TEST(SplitBackward, NoGradOrAnInputWithoutGradDefersNothing) {
  torch::manual_seed(1);
  Conv1D layer(64, 192);
  const torch::Tensor x = torch::randn({2, 5, 64});
  layer->forward(x).sum().backward();
  const torch::Tensor want = layer->weight.grad().clone();
  layer->zero_grad();

  WeightGradStore store;
  DeferWeightGradients defer(&store);
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(layer->forward(x.detach().requires_grad_(true)).requires_grad());
  }
  EXPECT_TRUE(store.empty());
  layer->forward(x).sum().backward();
  EXPECT_TRUE(store.empty());
  ASSERT_TRUE(layer->weight.grad().defined());
  EXPECT_TRUE(torch::equal(layer->weight.grad(), want));
}

// Puts from several threads all land; flush runs the products in the order put, accumulates
// each as AccumulateGrad does (the first becomes .grad, never aliasing a tensor someone holds; the
// rest are added in place) and empties the store.
TEST(SplitBackward, PutsFromOtherThreadsAreFlushedInOrderAndTheStoreEmpties) {
  const torch::Tensor p = torch::zeros({2, 3}).requires_grad_(true);
  const torch::Tensor q = torch::zeros({4}).requires_grad_(true);
  const torch::Tensor kept = torch::full({2, 3}, 2.0);
  std::vector<int> order;
  WeightGradStore store;
  store.put(p, [&] { order.push_back(0); return kept; });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      store.put(p, [] { return torch::ones({2, 3}); });
      store.put(q, [t] { return torch::full({4}, static_cast<double>(t)); });
    });
  }
  for (auto& thread : threads) thread.join();
  store.put(q, [&] { order.push_back(1); return torch::zeros({4}); });
  EXPECT_EQ(store.size(), 10u);
  store.flush();
  EXPECT_TRUE(store.empty());
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
  EXPECT_TRUE(torch::equal(p.grad(), torch::full({2, 3}, 6.0)));
  EXPECT_TRUE(torch::equal(q.grad(), torch::full({4}, 6.0)));
  EXPECT_TRUE(torch::equal(kept, torch::full({2, 3}, 2.0)));  // not accumulated into

  const void* storage = p.grad().data_ptr();
  store.put(p, [] { return torch::ones({2, 3}); });
  store.flush();
  EXPECT_EQ(p.grad().data_ptr(), storage);  // in place
  EXPECT_TRUE(torch::equal(p.grad(), torch::full({2, 3}, 7.0)));
  store.flush();  // an empty store: nothing changes
  EXPECT_TRUE(torch::equal(p.grad(), torch::full({2, 3}, 7.0)));
}

TEST(SplitBackward, ANonLeafOrAMisshapenProductIsRefusedWithTheShapes) {
  WeightGradStore store;
  const torch::Tensor leaf = torch::zeros({2, 3}).requires_grad_(true);
  try {
    store.put(leaf * 2, [] { return torch::zeros({2, 3}); });
    ADD_FAILURE() << "a non-leaf was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("shape [2, 3] is not a leaf that requires grad"), std::string::npos)
        << e.what();
  }
  store.put(leaf, [] { return torch::zeros({3, 2}); });
  try {
    store.flush();
    ADD_FAILURE() << "a [3, 2] gradient was accumulated into a [2, 3] parameter";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("of shape [3, 2] on cpu for a parameter of shape [2, 3]"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace harness::model
