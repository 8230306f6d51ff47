// The worker side of the tensor-parallel tests: skipped in a normal run; started by
// tensor_parallel_test.cpp's launcher with HARNESS_TEST_WORKER=<scenario>, it plays that scenario
// and compares the split computation with the unsplit one it also computes locally.
#include <gtest/gtest.h>

#include <cstdio>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <cstdlib>
#include <map>

#include "../support/after_adamw.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/gpt2.h"
#include "harness/model/safetensors.h"
#include "harness/tensor_parallel/comm_ops.h"
#include "harness/tensor_parallel/group.h"
#include "harness/parallel/process_groups.h"
#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

namespace dp = harness::data_parallel;
using model::Conv1D;
using model::ParallelStyle;
using model::shard_tensor;
using model::ShardSpec;
using Kind = ShardSpec::Kind;

// Copies rank `rank`'s shards of an unsplit weight and bias into a layer.
void load_layer(Conv1D& layer, const at::Tensor& weight, const at::Tensor& bias, int rank, int world) {
  torch::NoGradGuard no_grad;
  layer->weight.copy_(shard_tensor(weight, layer->weight_spec(), rank, world));
  layer->bias.copy_(shard_tensor(bias, layer->bias_spec(), rank, world));
}

dp::DistOptions options_for(const dp::WorkerEnv& env) {
  dp::DistOptions options = dp::dist_options_for(env, dp::Backend::kGloo);
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

// ----- Conv1D's parallel styles against the unsplit layer and torch::nn::Linear -----------------

void linear_scenario(const dp::DistContext& tp) {
  const int rank = tp.rank, world = tp.world_size;
  const auto group = make_tensor_parallel_group(tp);
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
    // Built under a group, the layer draws the whole weight and keeps its slice: the same
    // numbers as the unsplit layer built from the same seed.
    torch::manual_seed(11);
    Conv1D whole(6, 12);
    torch::manual_seed(11);
    Conv1D column(6, 12, ParallelStyle::kColumn, group, parts);
    EXPECT_TRUE(torch::equal(column->weight, shard_tensor(whole->weight, spec, rank, world)));
    EXPECT_EQ(column->weight_spec().kind, Kind::kColumns);
    load_layer(column, w, b, rank, world);
    at::Tensor x = x0.clone().requires_grad_(true);
    const at::Tensor y = column(x);
    EXPECT_TRUE(close(y, shard_tensor(y_ref.detach(), spec, rank, world)));
    // Each rank's part of the loss; the input gradient sums them (copy_to_region).
    (y * shard_tensor(g, spec, rank, world)).sum().backward();
    EXPECT_TRUE(close(x.grad(), x_ref.grad())) << "input gradient";
    EXPECT_TRUE(close(column->weight.grad(), shard_tensor(w_ref.grad(), spec, rank, world))) << "weight";
    EXPECT_TRUE(close(column->bias.grad(), shard_tensor(b_ref.grad(), spec, rank, world))) << "bias";
  }

  // Row parallel [12 -> 6] against the transposed problem: y2 = z @ w2 + b2.
  const at::Tensor z0 = torch::randn({3, 5, 12});
  const at::Tensor w2 = torch::randn({12, 6}), b2 = torch::randn({6}), g2 = torch::randn({3, 5, 6});
  at::Tensor z_ref = z0.clone().requires_grad_(true);
  at::Tensor w2_ref = w2.clone().requires_grad_(true), b2_ref = b2.clone().requires_grad_(true);
  const at::Tensor y2_ref = torch::matmul(z_ref, w2_ref) + b2_ref;
  (y2_ref * g2).sum().backward();
  const ShardSpec rows{Kind::kRows, 1};
  Conv1D row(12, 6, ParallelStyle::kRow, group);
  EXPECT_EQ(row->bias_spec().kind, Kind::kReplicated);
  load_layer(row, w2, b2, rank, world);
  at::Tensor z = z0.narrow(-1, rank * 12 / world, 12 / world).clone().requires_grad_(true);
  const at::Tensor y = row(z);
  EXPECT_TRUE(close(y, y2_ref.detach()));
  (y * g2).sum().backward();
  EXPECT_TRUE(close(z.grad(), z_ref.grad().narrow(-1, rank * 12 / world, 12 / world))) << "input gradient";
  EXPECT_TRUE(close(row->weight.grad(), shard_tensor(w2_ref.grad(), rows, rank, world))) << "weight";
  // Added once after the reduction: the bias gradient is the unsplit one, not world x it.
  EXPECT_TRUE(close(row->bias.grad(), b2_ref.grad())) << "bias";
  // A whole input where the slice belongs is refused with both widths.
  try {
    row(z0);
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("input slice has 12 features"), std::string::npos) << e.what();
  }

  // Column -> tanh -> row (Megatron's MLP) against two torch::nn::Linear (weights [out, in]).
  torch::nn::Linear fc(6, 8), proj(8, 6);
  Conv1D column(6, 8, ParallelStyle::kColumn, group);
  Conv1D row2(8, 6, ParallelStyle::kRow, group);
  load_layer(column, fc->weight.detach().t(), fc->bias.detach(), rank, world);
  load_layer(row2, proj->weight.detach().t(), proj->bias.detach(), rank, world);
  at::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
  const at::Tensor want = proj(torch::tanh(fc(xa)));
  const at::Tensor got = row2(torch::tanh(column(xb)));
  EXPECT_TRUE(close(got, want.detach()));
  want.pow(2).sum().backward();
  got.pow(2).sum().backward();
  EXPECT_TRUE(close(xb.grad(), xa.grad()));
  EXPECT_TRUE(close(column->weight.grad(), shard_tensor(fc->weight.grad().t(), {Kind::kColumns, 1}, rank, world)));
  EXPECT_TRUE(close(column->bias.grad(), shard_tensor(fc->bias.grad(), {Kind::kColumns, 1}, rank, world)));
  EXPECT_TRUE(close(row2->weight.grad(), shard_tensor(proj->weight.grad().t(), rows, rank, world)));
  EXPECT_TRUE(close(row2->bias.grad(), proj->bias.grad()));
}

// ----- GPT-2 ----------------------------------------------------------------------------------

at::Tensor token_batch(int64_t batch, int64_t length, int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(vocab, {batch, length + 1}, torch::kLong);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}));
}

// Greedy decoding with the KV cache: `steps` new tokens after `prompt`, and the last logits.
std::pair<std::vector<int64_t>, at::Tensor> greedy(model::GPT2LMHeadModel& m, const at::Tensor& prompt, int steps) {
  torch::NoGradGuard no_grad;
  model::KVCache cache;
  at::Tensor logits = m->forward_cached(prompt, cache);
  std::vector<int64_t> tokens;
  for (int i = 0; i < steps; ++i) {
    const at::Tensor next = logits.select(1, logits.size(1) - 1).argmax(-1, /*keepdim=*/true);
    tokens.push_back(next.item<int64_t>());
    logits = m->forward_cached(next, cache);
  }
  return {tokens, logits};
}

void gpt2_scenario(const dp::DistContext& tp, const std::string& dir) {
  const model::GPT2Config config = testing::tiny_config();
  const auto group = make_tensor_parallel_group(tp);
  torch::manual_seed(5);
  model::GPT2LMHeadModel full(config);
  // The same seed gives the same weights, split: the one model, with a group.
  torch::manual_seed(5);
  model::GPT2LMHeadModel split(config, group);
  ASSERT_EQ(split->tensor_parallel(), group.get());
  EXPECT_EQ(split->unsplit_parameter_count(), model::count_parameters(*full));
  EXPECT_LT(model::count_parameters(*split), model::count_parameters(*full));
  {
    auto full_params = full->named_parameters();
    for (const auto& item : split->named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value(), split->shard(item.key(), full_params[item.key()]))) << item.key();
    }
  }
  // Shapes: this rank's heads of q, k and v; halves of the MLP.
  EXPECT_EQ(split->transformer->h->ptr<model::GPT2BlockImpl>(0)->attn->c_attn->weight.sizes(),
            (at::IntArrayRef{32, 3 * 32 / tp.world_size}));
  EXPECT_EQ(split->transformer->h->ptr<model::GPT2BlockImpl>(1)->mlp->c_proj->weight.sizes(),
            (at::IntArrayRef{128 / tp.world_size, 32}));

  const at::Tensor ids = token_batch(3, 9, config.vocab_size, 8);
  const at::Tensor input = ids.narrow(1, 0, 9), labels = ids.narrow(1, 1, 9);
  const at::Tensor logits_full = full->forward(input);
  const at::Tensor logits_split = split->forward(input);
  EXPECT_TRUE(close(logits_split, logits_full.detach(), 1e-5)) << "logits";
  lm_loss(logits_full, labels).backward();
  lm_loss(logits_split, labels).backward();

  const model::NamedTensors grads = split->full_gradients();
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
  const std::string saved = dir + "/model";
  model::save_pretrained(*split, saved, /*write=*/tp.rank == 0);  // collective; streamed by rank 0
  if (tp.rank == 0) {
    // What Hugging Face must compute from the split model's files: the unsplit model's logits
    // (tensor_parallel_test.cpp runs hf_load_check.py on them).
    const at::Tensor long_ids = token_batch(2, 12, config.vocab_size, 30).narrow(1, 0, 12);
    model::write_safetensors(dir + "/expected.safetensors",
                             {{"input_ids", long_ids.to(torch::kFloat)}, {"logits", full->forward(long_ids).detach()}});
  }
  dp::barrier(tp);
  const model::NamedTensors state = split->full_state();
  model::GPT2LMHeadModel loaded = model::from_pretrained(saved);
  auto loaded_params = loaded->named_parameters();
  EXPECT_EQ(state.size(), loaded_params.size());
  for (const auto& [name, tensor] : state) {
    EXPECT_TRUE(torch::equal(loaded_params[name], tensor)) << name;
    EXPECT_TRUE(close(tensor, full_params[name].detach(), 1e-6)) << name;
  }
  EXPECT_TRUE(close(loaded->forward(input), split->forward(input).detach(), 1e-5));
  // And back into a fresh split model, each rank reading its slices of the file: the same shards.
  torch::manual_seed(99);
  model::GPT2LMHeadModel reloaded(config, group);
  model::load_pretrained(*reloaded, saved);
  auto reloaded_params = reloaded->named_parameters();
  for (const auto& item : split->named_parameters()) {
    EXPECT_TRUE(torch::equal(reloaded_params[item.key()], item.value())) << item.key();
  }
  // Unsplit weights in memory load the same way.
  torch::manual_seed(98);
  model::GPT2LMHeadModel from_state(config, group);
  from_state->load_full_state(state);
  for (const auto& item : from_state->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), reloaded_params[item.key()])) << item.key();
  }

  // KV-cached greedy generation on the split model: token for token the unsplit model's.
  {
    const at::Tensor prompt = token_batch(1, 3, config.vocab_size, 40).narrow(1, 0, 3);
    const auto [want_tokens, want_logits] = greedy(loaded, prompt, 8);
    const auto [got_tokens, got_logits] = greedy(split, prompt, 8);
    EXPECT_EQ(got_tokens, want_tokens);
    EXPECT_TRUE(close(got_logits, want_logits, 1e-5)) << "logits after 8 cached steps";
  }

  // Training mode with dropout everywhere: the ranks draw the same masks on what they all hold
  // (their default generators stay in step), so the logits agree exactly across the group.
  {
    model::GPT2Config noisy = config;
    noisy.embd_pdrop = noisy.attn_pdrop = noisy.resid_pdrop = 0.2;
    torch::manual_seed(17);
    model::GPT2LMHeadModel dropping(noisy, group);
    dropping->train();
    for (int step = 0; step < 2; ++step) {
      const at::Tensor logits = dropping->forward(input).detach();
      const std::vector<at::Tensor> all = all_gather(logits, tp);
      EXPECT_TRUE(torch::equal(all[0], all[1])) << "step " << step;
    }
    const std::vector<at::Tensor> states =
        all_gather(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)).get_state(), tp);
    EXPECT_TRUE(torch::equal(states[0], states[1]));
    // The attention dropout drew from each rank's own stream, seeded differently per rank.
    const auto streams = group->rank_stream_states();
    ASSERT_EQ(streams.count("cpu"), 1u);
    const std::vector<at::Tensor> rank_streams = all_gather(streams.at("cpu"), tp);
    EXPECT_FALSE(torch::equal(rank_streams[0], rank_streams[1]));
  }
  dp::barrier(tp);
}

// ----- sequence parallelism ------------------------------------------------------------------

// gather_sequence and reduce_scatter_sequence against what they stand for, on T = 2 or 3 ranks:
// every rank builds every rank's tensors from one seed and checks its own result and gradient.
void sequence_collectives_scenario(const dp::DistContext& tp) {
  const int rank = tp.rank, T = tp.world_size;
  const int64_t part = 2;
  torch::manual_seed(41);
  std::vector<at::Tensor> parts, partials, upstream_whole, upstream_parts;
  for (int r = 0; r < T; ++r) {
    parts.push_back(torch::randn({3, part, 4}));
    partials.push_back(torch::randn({3, T * part, 4}));
    upstream_whole.push_back(torch::randn({3, T * part, 4}));
    upstream_parts.push_back(torch::randn({3, part, 4}));
  }
  // gather: forward, the parts joined in rank order; backward, every rank's upstream gradient
  // summed and this rank's part of it kept.
  at::Tensor mine = parts[rank].clone().requires_grad_(true);
  const at::Tensor gathered = gather_sequence(mine, 1, tp);
  EXPECT_TRUE(torch::equal(gathered, torch::cat(parts, 1)));
  (gathered * upstream_whole[rank]).sum().backward();
  at::Tensor summed = torch::zeros_like(upstream_whole[0]);
  for (const auto& g : upstream_whole) summed += g;
  EXPECT_TRUE(close(mine.grad(), summed.narrow(1, rank * part, part), 1e-6)) << "gather_sequence's backward";
  // reduce-scatter: forward, the partial sums added and this rank's part kept; backward, every
  // rank's upstream gradient of its part joined.
  at::Tensor partial = partials[rank].clone().requires_grad_(true);
  const at::Tensor scattered = reduce_scatter_sequence(partial, 1, tp);
  at::Tensor total = torch::zeros_like(partials[0]);
  for (const auto& p : partials) total += p;
  EXPECT_TRUE(close(scattered, total.narrow(1, rank * part, part), 1e-6)) << "reduce_scatter_sequence";
  (scattered * upstream_parts[rank]).sum().backward();
  EXPECT_TRUE(torch::equal(partial.grad(), torch::cat(upstream_parts, 1))) << "reduce_scatter_sequence's backward";
  // Along the last dimension too, and a length the group does not divide is refused before any
  // collective (every rank throws alike).
  const at::Tensor columns = reduce_scatter_sequence(partials[rank].transpose(1, 2).contiguous(), 2, tp);
  EXPECT_TRUE(close(columns, total.transpose(1, 2).narrow(2, rank * part, part), 1e-6));
  EXPECT_THROW(reduce_scatter_sequence(torch::zeros({2, T * part + 1, 4}), 1, tp), std::invalid_argument);
  EXPECT_THROW(gather_sequence(torch::zeros({2, 3}), 2, tp), std::invalid_argument);
  dp::barrier(tp);
}

// GPT-2 with sequence parallelism over T = 2: each rank holds half of the batch's tokens between
// the split layers (half of every sequence, or half of the rows), and the loss, every gradient and
// the logits are the unsplit model's.
void sequence_parallel_gpt2_scenario(const dp::DistContext& tp) {
  const model::GPT2Config config = testing::tiny_config();
  const auto group = make_tensor_parallel_group(tp);
  torch::manual_seed(5);
  model::GPT2LMHeadModel full(config);
  torch::manual_seed(5);
  model::GPT2LMHeadModel split(config, group);
  split->set_sequence_parallel(true);
  EXPECT_TRUE(split->sequence_parallel());

  // Three rows split along the sequence (half of each row's positions a rank), four along the
  // rows (two whole rows a rank).
  for (const int64_t rows : {3, 4}) {
    SCOPED_TRACE(std::to_string(rows) + " rows");
    const at::Tensor ids = token_batch(rows, 12, config.vocab_size, 8);
    const at::Tensor input = ids.narrow(1, 0, 12), labels = ids.narrow(1, 1, 12);
    at::Tensor weights = torch::ones({rows, 12});
    weights.narrow(1, 0, 3).zero_();  // a prompt the loss ignores
    const std::vector<int64_t> part = rows % tp.world_size == 0
                                          ? std::vector<int64_t>{rows / tp.world_size, 12, config.n_embd}
                                          : std::vector<int64_t>{rows, 12 / tp.world_size, config.n_embd};
    EXPECT_EQ(split->embed(input).sizes().vec(), part);
    EXPECT_EQ(split->forward_units(split->embed(input), 0, 2).sizes().vec(), part);
    split->zero_grad();
    full->zero_grad();
    const at::Tensor want = full->loss(input, labels, weights);
    const at::Tensor got = split->loss(input, labels, weights);
    EXPECT_TRUE(close(got, want.detach(), 1e-6)) << "loss";
    want.backward();
    got.backward();
    auto full_params = full->named_parameters();
    const model::NamedTensors grads = split->full_gradients();
    EXPECT_EQ(grads.size(), full_params.size());
    for (const auto& [name, grad] : grads) {
      EXPECT_TRUE(close(grad, full_params[name].grad(), 1e-6)) << "gradient of " << name;
    }
    // The LayerNorms', the row-parallel biases' and wpe's gradients were each rank's part alone,
    // summed over the group: every rank holds the same.
    EXPECT_EQ(split->replicated_gradient_divergence(), 0.0);
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(close(split->forward(input), full->forward(input), 1e-5)) << "forward's whole logits";
  }
  const at::Tensor ids = token_batch(3, 12, config.vocab_size, 8);
  const at::Tensor input = ids.narrow(1, 0, 12), labels = ids.narrow(1, 1, 12);
  at::Tensor weights = torch::ones({3, 12});
  // Rows and a sequence the group does not divide are refused, naming the flags.
  try {
    (void)split->loss(input.narrow(1, 0, 11), labels.narrow(1, 0, 11), weights.narrow(1, 0, 11));
    ADD_FAILURE() << "an odd sequence over two ranks was not refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--sequence_parallel"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--tensor_parallel_size 2"), std::string::npos) << e.what();
  }
  // Generation (the KV cache) stays whole: token for token the unsplit model's.
  {
    const at::Tensor prompt = token_batch(1, 3, config.vocab_size, 40).narrow(1, 0, 3);
    EXPECT_EQ(greedy(split, prompt, 6).first, greedy(full, prompt, 6).first);
  }
  // Dropout on the split activations draws from each rank's own stream; the default generators
  // stay in step, and the ranks agree on the loss.
  {
    model::GPT2Config noisy = config;
    noisy.embd_pdrop = noisy.attn_pdrop = noisy.resid_pdrop = 0.2;
    torch::manual_seed(17);
    model::GPT2LMHeadModel dropping(noisy, group);
    dropping->set_sequence_parallel(true);
    dropping->train();
    const at::Tensor loss = dropping->loss(input, labels, weights).detach().reshape({1});
    const std::vector<at::Tensor> losses = all_gather(loss, tp);
    EXPECT_TRUE(torch::equal(losses[0], losses[1]));
    const std::vector<at::Tensor> states =
        all_gather(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)).get_state(), tp);
    EXPECT_TRUE(torch::equal(states[0], states[1]));
  }
  // Refused without a group to split over.
  EXPECT_THROW(full->set_sequence_parallel(true), std::invalid_argument);
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
  const parallel::Layout layout = parallel::Layout::create(world.world_size, {/*tensor=*/T});
  const parallel::ProcessGroups groups = parallel::make_process_groups(world, options, layout);
  EXPECT_EQ(groups.tensor.world_size, T);
  EXPECT_EQ(groups.tensor.rank, world.rank % T);
  EXPECT_EQ(groups.data.world_size, world.world_size / T);
  EXPECT_EQ(groups.data.rank, world.rank / T);
  // Each group really spans its ranks: sum of world ranks over it.
  for (const auto* group : {&groups.tensor, &groups.data}) {
    at::Tensor r = torch::full({1}, static_cast<float>(world.rank));
    dp::all_reduce_sum(*group, r);
    const std::vector<int> ranks = group == &groups.tensor ? layout.tensor_parallel_group(world.rank)
                                                           : layout.data_parallel_group(world.rank);
    float want = 0;
    for (int q : ranks) want += static_cast<float>(q);
    EXPECT_EQ(r.item<float>(), want) << (group == &groups.tensor ? "tensor group " : "data group ")
                                     << parallel::ranks_text(ranks);
  }

  const model::GPT2Config config = testing::tiny_config();
  const int n_dp = layout.data_parallel_size();
  const at::Tensor ids = token_batch(2 * n_dp, 8, config.vocab_size, 21);
  std::map<std::string, at::Tensor> want_grads;
  model::GPT2LMHeadModel want = reference_step(config, ids, n_dp, want_grads);

  torch::manual_seed(5);  // reference_step's seed: the same weights, split
  model::GPT2LMHeadModel split(config, make_tensor_parallel_group(groups.tensor));
  torch::optim::AdamW optimizer(split->parameters(), torch::optim::AdamWOptions(kLearningRate));
  auto sync = dp::make_gradient_synchronizer(dp::GradientSyncKind::kBucketed, groups.data, 0.001);
  sync->attach(*split);
  const at::Tensor part = ids.narrow(0, groups.data.rank * 2, 2);
  optimizer.zero_grad();
  lm_loss(split->forward(part.narrow(1, 0, 8)), part.narrow(1, 1, 8)).backward();
  sync->finalize();
  EXPECT_EQ(split->replicated_gradient_divergence(), 0.0);
  const model::NamedTensors grads = split->full_gradients();
  EXPECT_EQ(grads.size(), want_grads.size());
  for (const auto& [name, grad] : grads) EXPECT_TRUE(close(grad, want_grads.at(name), 1e-6)) << "gradient of " << name;
  optimizer.step();

  // Adam's first step is about lr * sign(gradient), so a gradient that is zero up to rounding (the
  // key bias's, which softmax ignores) moves by a rounding-dependent amount up to lr: after the
  // gradients agree to 1e-5 of their largest above, the weights are compared as AdamW guarantees
  // (tests/support/after_adamw.h): every element within one step, each tensor's difference within
  // 1e-3 of the step's update (one element of h.1.mlp.c_fc.weight with a gradient below 1e-7
  // differs by 4.5e-5, 3.5e-5 of that update).
  std::map<std::string, at::Tensor> got_weights, want_weights;
  for (const auto& [name, tensor] : split->full_state()) got_weights[name] = tensor;
  for (const auto& item : want->named_parameters()) want_weights[item.key()] = item.value().detach();
  test_support::expect_weights_agree_after_adamw(got_weights, want_weights, config.n_embd, {kLearningRate, 1}, 1e-3,
                                                 "T=" + std::to_string(T));
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
  } else if (scenario == "sequence_collectives") {
    sequence_collectives_scenario(world);
  } else if (scenario == "sequence_parallel_gpt2") {
    sequence_parallel_gpt2_scenario(world);
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
