// The worker side of the vocabulary-parallel tests: skipped in a normal run; started by
// vocab_parallel_test.cpp's launcher with HARNESS_TEST_WORKER=<scenario>, each rank holds its
// slice of logits it also has whole and compares the split loss, gradient and arg-max with
// torch's on the whole logits.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <limits>

#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/gpt2.h"
#include "harness/model/loss.h"
#include "harness/model/safetensors.h"
#include "harness/model/vocab_parallel.h"
#include "harness/tensor_parallel/group.h"
#include "test_support.h"

namespace harness::tensor_parallel {
namespace {

namespace dp = harness::data_parallel;
namespace F = torch::nn::functional;
using model::TensorParallelGroup;
using ReduceOp = TensorParallelGroup::ReduceOp;

// Loose enough for any BLAS (AMD, Intel MKL) summing the exponentials in another order.
::testing::AssertionResult close(const at::Tensor& got, const at::Tensor& want, double atol = 1e-5) {
  if (got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " vs " << want.sizes();
  }
  const double diff = (got - want).abs().max().item<double>();
  if (diff <= atol + 1e-5 * want.abs().max().item<double>()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs difference " << diff;
}

// This rank's columns of whole logits [..., V].
at::Tensor slice_of(const at::Tensor& whole, const TensorParallelGroup& group) {
  const model::VocabularyRange range = model::vocabulary_range(whole.size(-1), group.rank(), group.size());
  return whole.narrow(-1, range.start, range.size());
}

void collectives_scenario(TensorParallelGroup& group) {
  const int r = group.rank(), T = group.size();
  const at::Tensor x = torch::tensor({static_cast<double>(r), -static_cast<double>(r), 1.0});
  EXPECT_TRUE(torch::equal(group.all_reduce(x, ReduceOp::kSum),
                           torch::tensor({T * (T - 1) / 2.0, -T * (T - 1) / 2.0, static_cast<double>(T)})));
  EXPECT_TRUE(torch::equal(group.all_reduce(x, ReduceOp::kMax), torch::tensor({T - 1.0, 0.0, 1.0})));
  EXPECT_TRUE(torch::equal(group.all_reduce(x, ReduceOp::kMin), torch::tensor({0.0, 1.0 - T, 1.0})));
  EXPECT_TRUE(torch::equal(x, torch::tensor({static_cast<double>(r), -static_cast<double>(r), 1.0})))
      << "the input is left as it was";
}

// Per-token losses and their gradient against torch's cross entropy on the whole logits, for
// vocabularies that T does not divide; padding labels (-100) count nothing.
void per_token_scenario(TensorParallelGroup& group) {
  for (const int64_t V : {int64_t{37}, int64_t{1417}}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    torch::manual_seed(11);  // every rank draws the same whole logits
    const int64_t N = 23;
    const at::Tensor whole = (torch::randn({N, V}) * 4.0).requires_grad_(true);
    at::Tensor labels = torch::randint(V, {N}, torch::kLong);
    labels.index_put_({torch::tensor({2, 9, 17})}, -100);
    labels[0] = 0;  // the first and the last id, on the first and the last rank
    labels[1] = V - 1;
    const at::Tensor upstream = torch::rand({N});

    const at::Tensor want = F::cross_entropy(whole, labels, F::CrossEntropyFuncOptions().reduction(torch::kNone));
    (want * upstream).sum().backward();

    const at::Tensor slice = slice_of(whole.detach(), group).clone().requires_grad_(true);
    const at::Tensor got = model::vocab_parallel_cross_entropy(slice, labels, V, group);
    EXPECT_TRUE(close(got, want.detach())) << "losses";
    EXPECT_EQ(got.index({labels.eq(-100)}).abs().max().item<float>(), 0.0f);
    (got * upstream).sum().backward();
    EXPECT_TRUE(close(slice.grad(), slice_of(whole.grad(), group))) << "gradient of the slice";

    // bf16 logits (autocast's) give a bf16 gradient and the fp32 loss of their values.
    const at::Tensor half = slice.detach().to(torch::kBFloat16).requires_grad_(true);
    const at::Tensor from_half = model::vocab_parallel_cross_entropy(half, labels, V, group);
    EXPECT_EQ(from_half.scalar_type(), torch::kFloat32);
    from_half.sum().backward();
    EXPECT_EQ(half.grad().scalar_type(), torch::kBFloat16);

    // A label outside the vocabulary, or a slice of the wrong width, is refused with the numbers.
    at::Tensor bad = labels.clone();
    bad[4] = V;
    try {
      model::vocab_parallel_cross_entropy(slice, bad, V, group);
      ADD_FAILURE() << "expected an error for label " << V;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("label " + std::to_string(V) + " (row 4)"), std::string::npos) << e.what();
    }
    EXPECT_THROW(model::vocab_parallel_cross_entropy(whole.detach(), labels, V, group), std::invalid_argument);
  }
}

// SPEC's weighted loss from the slices equals weighted_cross_entropy on the whole logits, with
// and without a micro-batch's weight_sum, value and gradient.
void weighted_scenario(TensorParallelGroup& group) {
  const int64_t B = 3, S = 7, V = 1417;
  torch::manual_seed(12);
  const at::Tensor whole = (torch::randn({B, S, V}) * 3.0).requires_grad_(true);
  at::Tensor labels = torch::randint(V, {B, S}, torch::kLong);
  at::Tensor weights = torch::randint(0, 2, {B, S}).to(torch::kFloat32);
  weights[0][0] = 1.0;
  labels[2][6] = -100;  // padding: a label the weights zero
  weights[2][6] = 0.0;
  const at::Tensor weight_sum = weights.sum() * 2.5;  // as if the batch had more micro-batches

  for (const bool with_sum : {false, true}) {
    SCOPED_TRACE(with_sum ? "with weight_sum" : "own weights' sum");
    if (whole.grad().defined()) whole.mutable_grad().zero_();
    const at::Tensor want = with_sum ? model::weighted_cross_entropy(whole, labels, weights, weight_sum)
                                     : model::weighted_cross_entropy(whole, labels, weights);
    want.backward();
    const at::Tensor slice = slice_of(whole.detach(), group).clone().requires_grad_(true);
    const at::Tensor got = model::vocab_parallel_weighted_cross_entropy(
        slice, labels, weights, with_sum ? weight_sum : at::Tensor(), V, group);
    EXPECT_EQ(got.dim(), 0);
    EXPECT_TRUE(close(got, want.detach())) << "loss";
    got.backward();
    EXPECT_TRUE(close(slice.grad(), slice_of(whole.grad(), group), 1e-6)) << "gradient of the slice";
  }
  // Against torch's own cross entropy too (mean over the tokens: all weights 1).
  const at::Tensor slice = slice_of(whole.detach(), group).clone().requires_grad_(true);
  const at::Tensor ones = torch::ones({B, S});
  at::Tensor valid = labels.clone();
  valid[2][6] = 5;
  EXPECT_TRUE(close(model::vocab_parallel_weighted_cross_entropy(slice, valid, ones, at::Tensor(), V, group),
                    F::cross_entropy(whole.detach().reshape({B * S, V}), valid.reshape({B * S}))));
  const at::Tensor no_weight = torch::zeros({B, S});
  EXPECT_THROW(model::vocab_parallel_weighted_cross_entropy(slice, labels, no_weight, at::Tensor(), V, group),
               std::invalid_argument);
}

// The arg-max over the slices: that of the whole rows, ties to the lowest id even across ranks,
// and only ids below the limit.
void argmax_scenario(TensorParallelGroup& group) {
  const int64_t V = 1417;
  torch::manual_seed(13);
  at::Tensor whole = torch::randn({6, V});
  whole[1].fill_(0.5);                  // all tied: id 0
  whole[2][V - 1] = 100.0;              // on the last rank
  whole[3][3] = 100.0;                  // tied across the first and the last rank: the lower id
  whole[3][V - 2] = 100.0;
  whole[4][V - 1] = -std::numeric_limits<float>::infinity();
  whole[5][V / 2] = 50.0;               // at a rank boundary's neighbourhood
  whole[5][V / 2 + 1] = 50.0;
  const at::Tensor got = model::vocab_parallel_argmax(slice_of(whole, group), V, V, group);
  EXPECT_TRUE(torch::equal(got, whole.argmax(1))) << got << "\nvs\n" << whole.argmax(1);
  EXPECT_EQ(got[3].item<int64_t>(), 3);
  // Only the first 700 ids compete: ranks holding none of them offer nothing.
  const int64_t limit = 700;
  EXPECT_TRUE(torch::equal(model::vocab_parallel_argmax(slice_of(whole, group), V, limit, group),
                           whole.narrow(1, 0, limit).argmax(1)));
  EXPECT_THROW(model::vocab_parallel_argmax(slice_of(whole, group), V, V + 1, group), std::invalid_argument);
}

// Every rank here before any goes on (files written by rank 0 are complete).
void dp_barrier(TensorParallelGroup& group) { group.all_reduce(torch::zeros({1}), ReduceOp::kSum); }

// ----- GPT-2 with its tied wte and head split over the vocabulary -----------------------------

// The real group, counting what its collectives carry: the loss and the greedy pick must move
// per-row numbers, never logits.
class CountingGroup final : public TensorParallelGroup {
 public:
  explicit CountingGroup(std::shared_ptr<TensorParallelGroup> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  at::Tensor copy_to_region(const at::Tensor& x) override { return inner_->copy_to_region(x); }
  at::Tensor reduce_from_region(const at::Tensor& x) override { return inner_->reduce_from_region(x); }
  std::vector<at::Tensor> all_gather(const at::Tensor& x) override {
    largest_gathered = std::max(largest_gathered, x.numel());
    return inner_->all_gather(x);
  }
  at::Tensor gather_sequence(const at::Tensor& x, int64_t dim) override {
    largest_gathered = std::max(largest_gathered, x.numel());
    return inner_->gather_sequence(x, dim);
  }
  at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim) override {
    largest_reduced = std::max(largest_reduced, x.numel());
    return inner_->reduce_scatter_sequence(x, dim);
  }
  at::Tensor all_reduce(const at::Tensor& x, ReduceOp op) override {
    largest_reduced = std::max(largest_reduced, x.numel());
    return inner_->all_reduce(x, op);
  }
  at::Tensor run_in_rank_stream(const c10::Device& device, const std::function<at::Tensor()>& fn) override {
    return inner_->run_in_rank_stream(device, fn);
  }
  std::map<std::string, at::Tensor> rank_stream_states() const override { return inner_->rank_stream_states(); }
  void set_rank_stream_states(const std::map<std::string, at::Tensor>& states) override {
    inner_->set_rank_stream_states(states);
  }
  void reset() { largest_gathered = largest_reduced = 0; }
  int64_t largest_gathered = 0, largest_reduced = 0;

 private:
  std::shared_ptr<TensorParallelGroup> inner_;
};

// The split model's loss, gradients and greedy tokens equal the unsplit model's (V = 61, which
// neither 2 nor 3 divides); its checkpoints load unsplit and unsplit ones load split.
void gpt2_scenario(const std::shared_ptr<TensorParallelGroup>& real, const std::string& dir) {
  model::GPT2Config config = testing::tiny_config();
  config.n_embd = 36;  // 6 heads and an MLP of 144: 2 and 3 ranks divide both
  config.n_head = 6;
  const int64_t V = config.vocab_size;
  const auto group = std::make_shared<CountingGroup>(real);
  torch::manual_seed(5);
  model::GPT2LMHeadModel full(config);
  torch::manual_seed(5);
  model::GPT2LMHeadModel split(config, group);
  const model::VocabularyRange range = model::vocabulary_range(V, group->rank(), group->size());
  EXPECT_EQ(split->transformer->wte->weight.sizes(), (at::IntArrayRef{range.size(), config.n_embd}));
  EXPECT_EQ(split->shards().at("transformer.wte.weight").spec.kind, model::ShardSpec::Kind::kBalancedRows);
  EXPECT_EQ(split->shards().at("transformer.wte.weight").full_shape, (std::vector<int64_t>{V, config.n_embd}));
  EXPECT_TRUE(torch::equal(split->transformer->wte->weight,
                           full->transformer->wte->weight.narrow(0, range.start, range.size())));
  EXPECT_EQ(split->unsplit_parameter_count(), model::count_parameters(*full));

  torch::manual_seed(21);
  const int64_t B = 3, S = 9;
  const at::Tensor ids = torch::randint(V, {B, S + 1}, torch::kLong);
  const at::Tensor input = ids.narrow(1, 0, S), labels = ids.narrow(1, 1, S);
  at::Tensor weights = torch::randint(0, 2, {B, S}).to(torch::kFloat32);
  weights[0][0] = 1.0;
  const at::Tensor weight_sum = weights.sum() * 2.0;
  for (const bool with_sum : {false, true}) {
    SCOPED_TRACE(with_sum ? "with weight_sum" : "own weights' sum");
    full->zero_grad();
    split->zero_grad();
    const at::Tensor sum = with_sum ? weight_sum : at::Tensor();
    const at::Tensor want = full->loss(input, labels, weights, sum);
    group->reset();
    const at::Tensor got = split->loss(input, labels, weights, sum);
    EXPECT_EQ(group->largest_gathered, 0) << "the loss gathers nothing";
    EXPECT_EQ(group->largest_reduced, B * S) << "the loss reduces one number per token at a time";
    EXPECT_TRUE(close(got, want.detach())) << "loss";
    want.backward();
    got.backward();
    auto full_params = full->named_parameters();
    for (const auto& [name, grad] : split->full_gradients()) {
      EXPECT_TRUE(close(grad, full_params[name].grad(), 1e-6)) << "gradient of " << name;
    }
    EXPECT_EQ(split->replicated_gradient_divergence(), 0.0);
  }
  // forward() still gives the whole logits, gathered.
  EXPECT_TRUE(close(split->forward(input), full->forward(input).detach()));

  // Greedy tokens through the KV cache: the same ids, the whole vocabulary or a tokenizer's 40.
  {
    torch::NoGradGuard no_grad;
    for (const int64_t vocabulary : {V, int64_t{40}}) {
      model::KVCache full_cache, split_cache;
      at::Tensor step_full = input.narrow(0, 0, 1), step_split = step_full;
      for (int i = 0; i < 5; ++i) {
        const int64_t want = full->next_token(step_full, full_cache, vocabulary);
        group->reset();
        const int64_t got = split->next_token(step_split, split_cache, vocabulary);
        EXPECT_EQ(group->largest_gathered, 2) << "one (value, id) pair per rank";
        EXPECT_EQ(got, want) << "token " << i << " of " << vocabulary;
        EXPECT_LT(got, vocabulary);
        step_full = step_split = torch::full({1, 1}, want, torch::kLong);
      }
    }
  }

  // Written at T, read whole; written whole, read at T; the uneven split's rows where they belong.
  const std::string split_dir = dir + "/split_" + std::to_string(group->size());
  model::save_pretrained(*split, split_dir, group->rank() == 0);
  dp_barrier(*group);
  model::GPT2LMHeadModel whole = model::from_pretrained(split_dir);
  auto whole_params = whole->named_parameters();
  for (const auto& item : full->named_parameters()) {
    EXPECT_TRUE(torch::equal(whole_params[item.key()], item.value())) << item.key();
  }
  const std::string whole_dir = dir + "/whole_" + std::to_string(group->size());
  if (group->rank() == 0) model::save_pretrained(*full, whole_dir);
  dp_barrier(*group);
  torch::manual_seed(77);
  model::GPT2LMHeadModel reloaded(config, group);
  model::load_pretrained(*reloaded, whole_dir);
  auto split_params = split->named_parameters();
  for (const auto& item : reloaded->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), split_params[item.key()])) << item.key();
  }
  torch::manual_seed(78);
  model::GPT2LMHeadModel from_state(config, group);
  from_state->load_full_state(full->full_state());
  EXPECT_TRUE(torch::equal(from_state->transformer->wte->weight, split->transformer->wte->weight));
}

TEST(VocabParallelWorker, Run) {
  const char* scenario_text = std::getenv(testing::kWorkerVariable);
  if (scenario_text == nullptr) GTEST_SKIP() << "only run as a worker by the vocabulary-parallel launcher tests";
  const std::string scenario = scenario_text;
  const auto env = dp::worker_env_from_environment();
  ASSERT_TRUE(env.has_value()) << "a worker needs RANK/WORLD_SIZE from the launcher";
  at::set_num_threads(1);
  dp::DistOptions options = dp::dist_options_for(*env, dp::Backend::kGloo);
  options.timeout = std::chrono::seconds(60);
  const auto group = make_tensor_parallel_group(dp::init_process_group(options));

  if (scenario == "vocab_loss") {
    collectives_scenario(*group);
    per_token_scenario(*group);
    weighted_scenario(*group);
    argmax_scenario(*group);
  } else if (scenario == "vocab_gpt2") {
    const char* dir = std::getenv(testing::kDirVariable);
    ASSERT_NE(dir, nullptr);
    gpt2_scenario(group, dir);
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
