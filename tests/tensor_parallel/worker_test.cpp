// The worker side of the tensor-parallel tests: skipped in a normal run; started by
// tensor_parallel_test.cpp's launcher with HARNESS_TEST_WORKER=<scenario>, it plays that scenario
// and compares the split computation with the unsplit one it also computes locally.
#include <gtest/gtest.h>

#include <cstdio>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <cstdlib>
#include <map>

#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/gpt2.h"
#include "harness/model/safetensors.h"
#include "harness/tensor_parallel/comm_ops.h"
#include "harness/tensor_parallel/gpt2_tensor_parallel.h"
#include "harness/tensor_parallel/layers.h"
#include "harness/tensor_parallel/parallel_context.h"
#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

namespace dp = harness::data_parallel;
using Kind = ShardSpec::Kind;

dp::DistOptions options_for(const dp::WorkerEnv& env) {
  dp::DistOptions options = dp::dist_options_for(env, "gloo");
  options.timeout = std::chrono::seconds(60);
  return options;
}

::testing::AssertionResult close(const at::Tensor& got, const at::Tensor& want, double atol = 1e-5) {
  if (got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " vs " << want.sizes();
  }
  const double diff = (got - want).abs().max().item<double>();
  if (diff <= atol + 1e-5 * want.abs().max().item<double>()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs difference " << diff;
}

// ----- linear layers against Conv1D and torch::nn::Linear -------------------------------------

void linear_scenario(const dp::DistContext& tp) {
  const int rank = tp.rank, world = tp.world_size;
  torch::manual_seed(3);  // the same full tensors on every rank
  const at::Tensor x0 = torch::randn({3, 5, 6});
  const at::Tensor w = torch::randn({6, 12}), b = torch::randn({12});
  const at::Tensor g = torch::randn({3, 5, 12});  // d loss / d y: loss = sum(y * g)

  // Unsplit reference (Conv1D): y = x @ w + b.
  at::Tensor x_ref = x0.clone().requires_grad_(true);
  at::Tensor w_ref = w.clone().requires_grad_(true), b_ref = b.clone().requires_grad_(true);
  const at::Tensor y_ref = torch::matmul(x_ref, w_ref) + b_ref;
  (y_ref * g).sum().backward();

  for (int64_t parts : {1, 3}) {
    SCOPED_TRACE("fused_parts " + std::to_string(parts));
    const ShardSpec spec{Kind::kColumns, parts};
    for (bool gather : {true, false}) {
      SCOPED_TRACE(gather ? "gather_output" : "local output");
      ColumnParallelLinearOptions o;
      o.in_features = 6;
      o.out_features = 12;
      o.fused_parts = parts;
      o.gather_output = gather;
      ColumnParallelLinear column(o, tp);
      column->load_full(w, b);
      EXPECT_TRUE(torch::equal(column->weight, shard_tensor(w, spec, rank, world)));
      at::Tensor x = x0.clone().requires_grad_(true);
      const at::Tensor y = column(x);
      if (gather) {
        // The gathered output is in rank order: with fused parts it is [q0 k0 v0 | q1 k1 v1].
        std::vector<at::Tensor> shards;
        for (int r = 0; r < world; ++r) shards.push_back(shard_tensor(y_ref.detach(), spec, r, world));
        EXPECT_TRUE(close(y, torch::cat(shards, -1)));
        std::vector<at::Tensor> g_shards;
        for (int r = 0; r < world; ++r) g_shards.push_back(shard_tensor(g, spec, r, world));
        (y * torch::cat(g_shards, -1)).sum().backward();
      } else {
        EXPECT_TRUE(close(y, shard_tensor(y_ref.detach(), spec, rank, world)));
        // Each rank's part of the loss; the input gradient sums them (copy_to_tp_region).
        (y * shard_tensor(g, spec, rank, world)).sum().backward();
      }
      EXPECT_TRUE(close(x.grad(), x_ref.grad())) << "input gradient";
      EXPECT_TRUE(close(column->weight.grad(), shard_tensor(w_ref.grad(), spec, rank, world))) << "weight";
      EXPECT_TRUE(close(column->bias.grad(), shard_tensor(b_ref.grad(), spec, rank, world))) << "bias";
    }
  }

  // Row parallel [12 -> 6] against the transposed problem: y2 = z @ w2 + b2.
  const at::Tensor z0 = torch::randn({3, 5, 12});
  const at::Tensor w2 = torch::randn({12, 6}), b2 = torch::randn({6}), g2 = torch::randn({3, 5, 6});
  at::Tensor z_ref = z0.clone().requires_grad_(true);
  at::Tensor w2_ref = w2.clone().requires_grad_(true), b2_ref = b2.clone().requires_grad_(true);
  const at::Tensor y2_ref = torch::matmul(z_ref, w2_ref) + b2_ref;
  (y2_ref * g2).sum().backward();
  const ShardSpec rows{Kind::kRows, 1};
  for (bool input_is_parallel : {true, false}) {
    SCOPED_TRACE(input_is_parallel ? "input_is_parallel" : "replicated input");
    RowParallelLinearOptions o;
    o.in_features = 12;
    o.out_features = 6;
    o.input_is_parallel = input_is_parallel;
    RowParallelLinear row(o, tp);
    row->load_full(w2, b2);
    at::Tensor z = input_is_parallel ? z0.narrow(-1, rank * 12 / world, 12 / world).clone() : z0.clone();
    z.requires_grad_(true);
    const at::Tensor y = row(z);
    EXPECT_TRUE(close(y, y2_ref.detach()));
    (y * g2).sum().backward();
    const at::Tensor z_grad_want =
        input_is_parallel ? z_ref.grad().narrow(-1, rank * 12 / world, 12 / world) : z_ref.grad();
    EXPECT_TRUE(close(z.grad(), z_grad_want)) << "input gradient";
    EXPECT_TRUE(close(row->weight.grad(), shard_tensor(w2_ref.grad(), rows, rank, world))) << "weight";
    // Added once after the reduction: the bias gradient is the unsplit one, not world x it.
    EXPECT_TRUE(close(row->bias.grad(), b2_ref.grad())) << "bias";
  }

  // Column -> tanh -> row (Megatron's MLP) against two torch::nn::Linear (weights [out, in]).
  torch::nn::Linear fc(6, 8), proj(8, 6);
  ColumnParallelLinearOptions co;
  co.in_features = 6;
  co.out_features = 8;
  RowParallelLinearOptions ro;
  ro.in_features = 8;
  ro.out_features = 6;
  ColumnParallelLinear column(co, tp);
  RowParallelLinear row(ro, tp);
  column->load_full(fc->weight.detach().t(), fc->bias.detach());
  row->load_full(proj->weight.detach().t(), proj->bias.detach());
  at::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
  const at::Tensor want = proj(torch::tanh(fc(xa)));
  const at::Tensor got = row(torch::tanh(column(xb)));
  EXPECT_TRUE(close(got, want.detach()));
  want.pow(2).sum().backward();
  got.pow(2).sum().backward();
  EXPECT_TRUE(close(xb.grad(), xa.grad()));
  EXPECT_TRUE(close(column->weight.grad(), shard_tensor(fc->weight.grad().t(), {Kind::kColumns, 1}, rank, world)));
  EXPECT_TRUE(close(column->bias.grad(), shard_tensor(fc->bias.grad(), {Kind::kColumns, 1}, rank, world)));
  EXPECT_TRUE(close(row->weight.grad(), shard_tensor(proj->weight.grad().t(), rows, rank, world)));
  EXPECT_TRUE(close(row->bias.grad(), proj->bias.grad()));
}

// ----- GPT-2 ----------------------------------------------------------------------------------

at::Tensor token_batch(int64_t batch, int64_t length, int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(vocab, {batch, length + 1}, torch::kLong);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}));
}

void gpt2_scenario(const dp::DistContext& tp, const std::string& dir) {
  const model::GPT2Config config = testing::tiny_config();
  torch::manual_seed(5);
  model::GPT2LMHeadModel full(config);
  torch::manual_seed(6);
  TensorParallelGPT2LMHeadModel split(config, tp);
  split->load_from(*full);
  // Shapes: this rank's heads of q, k and v; halves of the MLP.
  EXPECT_EQ(split->transformer->h->ptr<TensorParallelGPT2BlockImpl>(0)->attn->c_attn->weight.sizes(),
            (at::IntArrayRef{32, 3 * 32 / tp.world_size}));
  EXPECT_EQ(split->transformer->h->ptr<TensorParallelGPT2BlockImpl>(1)->mlp->c_proj->weight.sizes(),
            (at::IntArrayRef{128 / tp.world_size, 32}));

  const at::Tensor ids = token_batch(3, 9, config.vocab_size, 8);
  const at::Tensor input = ids.narrow(1, 0, 9), labels = ids.narrow(1, 1, 9);
  const at::Tensor logits_full = full->forward(input);
  const at::Tensor logits_split = split->forward(input);
  EXPECT_TRUE(close(logits_split, logits_full.detach(), 1e-5)) << "logits";
  lm_loss(logits_full, labels).backward();
  lm_loss(logits_split, labels).backward();

  const model::NamedTensors grads = split->gather_full_gradients();
  auto full_params = full->named_parameters();
  EXPECT_EQ(grads.size(), full_params.size());
  for (const auto& [name, grad] : grads) {
    const at::Tensor* p = full_params.find(name);
    ASSERT_NE(p, nullptr) << name;
    EXPECT_TRUE(close(grad, p->grad(), 1e-6)) << "gradient of " << name;
  }
  // Replicated parameters (embeddings, LayerNorms, row-parallel biases) get the same gradient on
  // every rank of the group without any extra communication.
  EXPECT_EQ(split->replicated_gradient_divergence(), 0.0);

  // One SGD step on both, then save from the split model: the unsplit model loads the files and
  // holds exactly the gathered weights (and the weights the unsplit step gave).
  {
    torch::NoGradGuard no_grad;
    for (auto& p : full->parameters()) p.sub_(0.1 * p.grad());
    for (auto& p : split->parameters()) p.sub_(0.1 * p.grad());
  }
  save_pretrained(*split, dir);
  dp::barrier(tp);
  const model::NamedTensors state = split->gather_full_state();
  model::GPT2LMHeadModel loaded = model::from_pretrained(dir);
  auto loaded_params = loaded->named_parameters();
  EXPECT_EQ(state.size(), loaded_params.size());
  for (const auto& [name, tensor] : state) {
    EXPECT_TRUE(torch::equal(loaded_params[name], tensor)) << name;
    EXPECT_TRUE(close(tensor, full_params[name].detach(), 1e-6)) << name;
  }
  EXPECT_TRUE(close(loaded->forward(input), split->forward(input).detach(), 1e-5));
  // And back into a fresh split model: the same shards.
  torch::manual_seed(99);
  TensorParallelGPT2LMHeadModel reloaded(config, tp);
  load_pretrained(*reloaded, dir);
  auto reloaded_params = reloaded->named_parameters();
  for (const auto& item : split->named_parameters()) {
    EXPECT_TRUE(torch::equal(reloaded_params[item.key()], item.value())) << item.key();
  }
  // Training mode with dropout everywhere: the ranks draw the same masks on what they all hold
  // (their default generators stay in step), so the logits agree exactly across the group.
  {
    model::GPT2Config noisy = config;
    noisy.embd_pdrop = noisy.attn_pdrop = noisy.resid_pdrop = 0.2;
    torch::manual_seed(17);
    TensorParallelGPT2LMHeadModel dropping(noisy, tp);
    dropping->train();
    for (int step = 0; step < 2; ++step) {
      const at::Tensor logits = dropping->forward(input).detach();
      const std::vector<at::Tensor> all = all_gather(logits, tp);
      EXPECT_TRUE(torch::equal(all[0], all[1])) << "step " << step;
    }
    const std::vector<at::Tensor> states =
        all_gather(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)).get_state(), tp);
    EXPECT_TRUE(torch::equal(states[0], states[1]));
  }
  // copy_into fills an unsplit model with the same numbers.
  model::GPT2LMHeadModel copy(config);
  split->copy_into(*copy);
  EXPECT_TRUE(torch::equal(copy->forward(input), loaded->forward(input)));
  dp::barrier(tp);
}

constexpr double kLearningRate = 1e-2;

// One AdamW step of the unsplit model on the data-parallel average of `n_dp` equal slices of a
// batch: what T x DP ranks must reproduce. `grads` receives the averaged gradients.
model::GPT2LMHeadModel reference_step(const model::GPT2Config& config, const at::Tensor& ids, int n_dp,
                                      std::map<std::string, at::Tensor>& grads) {
  torch::manual_seed(5);
  model::GPT2LMHeadModel full(config);
  torch::optim::AdamW optimizer(full->parameters(), torch::optim::AdamWOptions(kLearningRate));
  const int64_t rows = ids.size(0) / n_dp;
  std::vector<at::Tensor> sums;
  for (int d = 0; d < n_dp; ++d) {
    optimizer.zero_grad();
    const at::Tensor part = ids.narrow(0, d * rows, rows);
    lm_loss(full->forward(part.narrow(1, 0, part.size(1) - 1)), part.narrow(1, 1, part.size(1) - 1)).backward();
    const auto params = full->parameters();
    if (sums.empty()) {
      for (const auto& p : params) sums.push_back(p.grad().clone());
    } else {
      for (size_t i = 0; i < params.size(); ++i) sums[i] += params[i].grad();
    }
  }
  auto params = full->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = sums[i] / n_dp;
  for (const auto& item : full->named_parameters()) grads[item.key()] = item.value().grad().clone();
  optimizer.step();
  return full;
}

// T x DP ranks: groups from the world, data split over the data-parallel ranks only, gradient
// averaging over the data group, then AdamW; the gathered weights equal reference_step's.
void training_step_scenario(const dp::DistContext& world, const dp::DistOptions& options, int T) {
  ParallelContext parallel = make_parallel_context(world, options, T);
  const ParallelLayout& layout = parallel.layout;
  EXPECT_EQ(parallel.tensor.world_size, T);
  EXPECT_EQ(parallel.tensor.rank, world.rank % T);
  EXPECT_EQ(parallel.data.world_size, world.world_size / T);
  EXPECT_EQ(parallel.data.rank, world.rank / T);
  // Each group really spans its ranks: sum of world ranks over it.
  for (const auto* group : {&parallel.tensor, &parallel.data}) {
    at::Tensor r = torch::full({1}, static_cast<float>(world.rank));
    dp::all_reduce_sum(*group, r);
    const auto& ranks = group == &parallel.tensor ? layout.tensor_group_ranks : layout.data_group_ranks;
    float want = 0;
    for (int q : ranks) want += static_cast<float>(q);
    EXPECT_EQ(r.item<float>(), want) << (group == &parallel.tensor ? "tensor group " : "data group ")
                                     << ranks_text(ranks);
  }

  const model::GPT2Config config = testing::tiny_config();
  const int n_dp = layout.data_parallel_size;
  const at::Tensor ids = token_batch(2 * n_dp, 8, config.vocab_size, 21);
  std::map<std::string, at::Tensor> want_grads;
  model::GPT2LMHeadModel want = reference_step(config, ids, n_dp, want_grads);

  torch::manual_seed(5);
  model::GPT2LMHeadModel initial(config);
  TensorParallelGPT2LMHeadModel split(config, parallel.tensor);
  split->load_from(*initial);
  torch::optim::AdamW optimizer(split->parameters(), torch::optim::AdamWOptions(kLearningRate));
  auto sync = dp::make_gradient_synchronizer("bucketed", parallel.data, 0.001);
  sync->attach(*split);
  const at::Tensor part = ids.narrow(0, layout.data_rank * 2, 2);
  optimizer.zero_grad();
  lm_loss(split->forward(part.narrow(1, 0, 8)), part.narrow(1, 1, 8)).backward();
  sync->finalize();
  EXPECT_EQ(split->replicated_gradient_divergence(), 0.0);
  const model::NamedTensors grads = split->gather_full_gradients();
  EXPECT_EQ(grads.size(), want_grads.size());
  for (const auto& [name, grad] : grads) EXPECT_TRUE(close(grad, want_grads.at(name), 1e-6)) << "gradient of " << name;
  optimizer.step();

  // Adam's first step is about lr * sign(gradient), so a gradient that is zero up to rounding (the
  // key bias's, which softmax ignores) moves by a rounding-dependent amount up to lr: the weights
  // are compared to 1% of lr, after checking above that the gradients agree to 1e-6.
  auto want_params = want->named_parameters();
  for (const auto& [name, tensor] : split->gather_full_state()) {
    EXPECT_TRUE(close(tensor, want_params[name].detach(), 1e-2 * kLearningRate)) << name;
  }
  dp::barrier(world);
}

TEST(TpWorker, Run) {
  const char* scenario_text = std::getenv(testing::kWorkerVariable);
  if (scenario_text == nullptr) GTEST_SKIP() << "only run as a worker by the tensor-parallel launcher tests";
  const std::string scenario = scenario_text;
  const auto env = dp::worker_env_from_environment();
  ASSERT_TRUE(env.has_value()) << "a worker needs RANK/WORLD_SIZE from the launcher";
  at::set_num_threads(1);
  const dp::DistOptions options = options_for(*env);
  const dp::DistContext world = dp::init_process_group(options);

  if (scenario == "linear") {
    linear_scenario(world);
  } else if (scenario == "gpt2") {
    const char* dir = std::getenv(testing::kDirVariable);
    ASSERT_NE(dir, nullptr);
    gpt2_scenario(world, dir);
  } else if (scenario == "step_tp2") {
    training_step_scenario(world, options, 2);
  } else {
    FAIL() << "unknown scenario " << scenario;
  }
  if (!::testing::Test::HasFailure()) {
    std::printf("scenario %s passed on rank %d\n", scenario.c_str(), env->rank);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace harness::tensor_parallel
