// The worker side of the multi-process tests: skipped in a normal run; when the launcher in
// another test starts this binary with HARNESS_TEST_WORKER=<scenario>, it plays that scenario.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <tuple>

#include "../support/after_adamw.h"
#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/checkpoint_io.h"
#include "harness/data_parallel/debug_sync.h"
#include "harness/data_parallel/elastic_rendezvous.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/data_parallel/ring_all_reduce.h"
#include "harness/zero/sharded_adamw.h"
#include "test_support.h"

namespace harness::data_parallel {
namespace {

using zero::AdamWHyperparameters;
using zero::ShardedAdamW;

[[noreturn]] void sleep_then_exit(int seconds) {
  for (int i = 0; i < seconds * 10; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::_Exit(0);
}

DistContext connect(const WorkerEnv& env) {
  DistOptions options = dist_options_for(env, Backend::kGloo);
  options.timeout = std::chrono::seconds(60);
  return init_process_group(options);
}

// A small model whose weights are the same on every rank (fixed seed) and per-rank data.
torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::Tanh(), torch::nn::Linear(4, 3));
}

at::Tensor rank_input(int rank) {
  return torch::linspace(-1.0, 1.0, 6 * 5).reshape({6, 5}) * (rank + 1) + 0.25 * rank;
}

// d(sum of squares of outputs)/d(params) for one rank's data: the expected per-rank gradients.
std::vector<at::Tensor> local_gradients(int rank) {
  auto model = make_model();
  model->forward(rank_input(rank)).pow(2).sum().backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

// Rank r's contribution in the ring tests: random data fixed by (length, rank), so that every
// rank can also compute the expected sum locally.
at::Tensor ring_input(int64_t length, int rank, at::ScalarType dtype) {
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * length + rank));
  return at::randn({length}, generator, torch::TensorOptions().dtype(torch::kFloat64)).to(dtype);
}

// Rank 0's copy of `tensor`, broadcast to every rank (to check the ranks agree bit for bit).
at::Tensor from_rank0(const DistContext& ctx, const at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor.clone()};
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  ctx.group->broadcast(tensors, options)->wait();
  return tensors[0];
}

// Ring against built-in all-reduce and against the locally computed sum: every length from empty
// through shorter than the world to uneven chunks and a long odd one, sum and mean, float32 and
// float64.
void ring_scenario(const DistContext& ctx) {
  const int n = ctx.world_size;
  for (const int64_t length : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{7}, int64_t{1001},
                               int64_t{1000003}}) {
    for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
      if (length > 100000 && dtype == torch::kFloat64) continue;  // the long one once, for time
      for (const auto kind : {ReduceKind::kSum, ReduceKind::kMean}) {
        const std::string what = "length " + std::to_string(length) + " dtype " +
                                 std::string(c10::toString(dtype)) +
                                 (kind == ReduceKind::kMean ? " mean" : " sum");
        at::Tensor expected = torch::zeros({length}, torch::kFloat64);
        for (int r = 0; r < n; ++r) expected += ring_input(length, r, dtype).to(torch::kFloat64);
        if (kind == ReduceKind::kMean) expected /= n;
        at::Tensor ring = ring_input(length, ctx.rank, dtype);
        at::Tensor builtin = ring.clone();
        const void* storage = ring.data_ptr();
        ring_all_reduce(ctx, ring, kind);
        all_reduce(ctx, builtin, AllReduceAlgorithm::kBuiltin, kind);
        EXPECT_EQ(ring.data_ptr(), storage) << what << ": not in place";
        const double tolerance = dtype == torch::kFloat32 ? 1e-5 : 1e-12;
        EXPECT_TRUE(torch::allclose(ring.to(torch::kFloat64), expected, tolerance, tolerance)) << what;
        EXPECT_TRUE(torch::allclose(ring, builtin, tolerance, tolerance)) << what;
        EXPECT_TRUE(torch::equal(ring, from_rank0(ctx, ring))) << what << ": ranks disagree";
      }
    }
  }
  // Integer-valued floats add exactly in any order: ring equals built-in bit for bit.
  at::Tensor exact = torch::arange(1001, torch::kFloat32) * (ctx.rank + 1) - 17.0 * ctx.rank;
  at::Tensor exact_builtin = exact.clone();
  ring_all_reduce(ctx, exact);
  builtin_all_reduce(ctx, exact_builtin);
  EXPECT_TRUE(torch::equal(exact, exact_builtin));
  // A non-contiguous tensor goes through a buffer and lands back in place.
  at::Tensor strided = torch::ones({5, 3}).t() * (ctx.rank + 1);
  ring_all_reduce(ctx, strided);
  EXPECT_TRUE(torch::equal(strided, torch::full({3, 5}, n * (n + 1) / 2.0)));
  // bfloat16 sums close to the exact one (each step rounds to 8 bits of mantissa).
  at::Tensor half = ring_input(333, ctx.rank, torch::kBFloat16);
  ring_all_reduce(ctx, half, ReduceKind::kMean);
  at::Tensor half_expected = torch::zeros({333}, torch::kFloat64);
  for (int r = 0; r < n; ++r) half_expected += ring_input(333, r, torch::kBFloat16).to(torch::kFloat64);
  EXPECT_TRUE(torch::allclose(half.to(torch::kFloat64), half_expected / n, 3e-2, 3e-2));
  // Integer tensors sum; a mean of them is refused with the dtype named.
  at::Tensor ints = torch::full({4}, ctx.rank + 1, torch::kInt64);
  ring_all_reduce(ctx, ints);
  EXPECT_TRUE(torch::equal(ints, torch::full({4}, n * (n + 1) / 2, torch::kInt64)));
  try {
    ring_all_reduce(ctx, ints, ReduceKind::kMean);
    ADD_FAILURE() << "a mean of an integer tensor was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Long"), std::string::npos) << e.what();
  }
  barrier(ctx);
}

// Ring gradient synchronisation equals built-in, with both sync modes, over three steps (the last
// with two backward calls); an unused parameter stays without a gradient.
void ring_grad_sync_scenario(const DistContext& ctx) {
  auto make = [] {
    torch::manual_seed(11);
    return torch::nn::Sequential(torch::nn::Linear(5, 16), torch::nn::Tanh(),
                                 torch::nn::Linear(16, 16), torch::nn::Tanh(),
                                 torch::nn::Linear(16, 3));
  };
  struct Variant {
    std::string grad_sync;
    AllReduceAlgorithm allreduce;
  };
  const std::vector<Variant> variants = {{"naive", AllReduceAlgorithm::kBuiltin},
                                         {"naive", AllReduceAlgorithm::kRing},
                                         {"bucketed", AllReduceAlgorithm::kBuiltin},
                                         {"bucketed", AllReduceAlgorithm::kRing}};
  std::vector<torch::nn::Sequential> models;
  std::vector<std::vector<at::Tensor>> params;
  std::vector<torch::nn::Linear> unused;
  std::vector<std::unique_ptr<GradientSynchronizer>> syncs;
  for (const auto& v : variants) {
    models.push_back(make());
    unused.emplace_back(3, 3);
    params.push_back(models.back()->parameters());
    for (const auto& p : unused.back()->parameters()) params.back().push_back(p);
    // 400-byte buckets: several buckets, so the ring thread runs more than one per step.
    syncs.push_back(make_gradient_synchronizer(parse_gradient_sync(v.grad_sync), ctx, 400.0 / (1024 * 1024), v.allreduce));
    syncs.back()->attach(params.back());
  }
  EXPECT_EQ(syncs[3]->name(), "bucketed+ring");
  EXPECT_EQ(syncs[1]->name(), "naive+ring");
  for (int step = 0; step < 3; ++step) {
    for (auto& list : params) {
      for (auto& p : list) p.mutable_grad() = at::Tensor();
    }
    for (int k = 0; k < (step == 2 ? 2 : 1); ++k) {
      const at::Tensor x = rank_input(ctx.rank) * (step + 1) - 0.1 * k;
      for (auto& model : models) model->forward(x).pow(2).sum().backward();
    }
    // The bucketed ring's thread (tag space 1) may still be reducing while the naive ring runs
    // on this thread (tag space 0): the tag spaces keep their messages apart.
    for (auto& sync : syncs) sync->finalize();
    for (size_t v = 1; v < variants.size(); ++v) {
      for (size_t i = 0; i < params[0].size(); ++i) {
        const at::Tensor& want = params[0][i].grad();
        const at::Tensor& got = params[v][i].grad();
        ASSERT_EQ(want.defined(), got.defined()) << syncs[v]->name() << " parameter " << i;
        if (!want.defined()) continue;
        EXPECT_TRUE(torch::allclose(got, want, 1e-6, 1e-7))
            << syncs[v]->name() << " parameter " << i << " step " << step;
        // The ring leaves the same bits on every rank.
        EXPECT_TRUE(torch::equal(got, from_rank0(ctx, got))) << syncs[v]->name() << " parameter " << i;
      }
      EXPECT_FALSE(unused[v]->weight.grad().defined());
    }
  }
  barrier(ctx);
}

// Rank 1 leaves the head `b` unused in steps 1 and 3, rank 0 uses it every step; in step 2 rank
// 1 uses it again (for the bucketed kind, after presuming it unused, so that its bucket goes
// stale on rank 1 only). Each step must finish (no rank issues a collective the other does not),
// and every rank must hold the average of the ranks' gradients, a missing one counting as zero,
// for every parameter.
void unused_on_one_rank_scenario(const DistContext& ctx, const std::string& kind) {
  torch::manual_seed(5);
  torch::nn::Linear a(4, 8), b(8, 2), c(8, 2);
  std::vector<at::Tensor> params;
  for (auto* m : {&a, &b, &c}) {
    for (const auto& p : (*m)->parameters()) params.push_back(p);
  }
  auto sync = make_gradient_synchronizer(parse_gradient_sync(kind), ctx, /*bucket_cap_mb=*/64.0 / (1024 * 1024));
  sync->attach(params);
  if (const auto* bucketed = dynamic_cast<const BucketedAllReduce*>(sync.get())) {
    EXPECT_GE(bucketed->bucket_plan().size(), 3u);  // several buckets
  }
  for (int step = 0; step < 4; ++step) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    const at::Tensor h = torch::tanh(a->forward(rank_input(ctx.rank).narrow(1, 0, 4) * (step + 1)));
    const bool use_b = ctx.rank == 0 || step % 2 == 0;
    (use_b ? b->forward(h) + c->forward(h) : c->forward(h)).pow(2).sum().backward();
    std::vector<at::Tensor> local;
    for (const auto& p : params) local.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    sync->finalize();
    for (size_t i = 0; i < params.size(); ++i) {
      all_reduce_sum(ctx, local[i]);  // the oracle, after finalize: the same order on both ranks
      ASSERT_TRUE(params[i].grad().defined()) << "parameter " << i << " step " << step;
      EXPECT_TRUE(torch::allclose(params[i].grad(), local[i] / 2.0, 1e-6, 1e-7))
          << "parameter " << i << " step " << step;
    }
  }
}

// ZeRO-1 against the replicated AdamW: the same model on every rank, per-rank data; one copy
// steps with ShardedAdamW over reduce-scattered buckets (several, of lengths the world size does
// not divide), the other with torch::optim::AdamW over naive-averaged gradients. After 3 steps
// the weights agree, each rank holds about 1/N of the state, and the gathered state is AdamW's.
void zero_scenario(const DistContext& ctx) {
  auto sharded = make_model(), replicated = make_model();
  BucketedAllReduce gradients(ctx, 64.0 / (1024 * 1024), AllReduceAlgorithm::kBuiltin,
                              GradientReduction::kReduceScatter);
  gradients.attach(*sharded);
  EXPECT_GE(gradients.bucket_plan().size(), 2u);
  AdamWHyperparameters options;
  options.lr = 0.05;
  ShardedAdamW zero(gradients, sharded->parameters(), options);
  NaiveAllReduce average(ctx);
  average.attach(*replicated);
  torch::optim::AdamW adamw(replicated->parameters(), torch::optim::AdamWOptions(0.05));
  for (int step = 0; step < 3; ++step) {
    for (auto* model : {&sharded, &replicated}) {
      for (auto& p : (*model)->parameters()) p.mutable_grad() = at::Tensor();
      (*model)->forward(rank_input(ctx.rank) * (step + 1)).pow(2).sum().backward();
    }
    gradients.finalize();
    zero.step();
    average.finalize();
    adamw.step();
  }
  const auto a = sharded->parameters(), b = replicated->parameters();
  int64_t elements = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    // The two sum the ranks' gradients in other orders, and AdamW normalises each element's
    // gradient: compared as AdamW guarantees (tests/support/after_adamw.h), each tensor's
    // difference within 1e-5 of the steps' update, every element within what 3 steps of lr 0.05
    // can move it.
    EXPECT_TRUE(test_support::agree_after_adamw(a[i], b[i], {0.05, 3}, 1e-5)) << "parameter " << i;
    elements += a[i].numel();
  }
  const int64_t buckets = static_cast<int64_t>(gradients.bucket_plan().size());
  EXPECT_LE(zero.state_bytes(), 2 * 4 * ((elements + ctx.world_size - 1) / ctx.world_size + buckets));
  const ShardedAdamW::FullState full = zero.gather_state();
  EXPECT_EQ(full.step, 3);
  auto& states = adamw.state();
  for (size_t i = 0; i < b.size(); ++i) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*states.at(b[i].unsafeGetTensorImpl()));
    // Over Gloo each rank sums its chunk of the gradients in rank order, the all-reduce behind the
    // replicated copy in ring order: the sums may differ in their last bit, so an element's
    // tolerance is relative to the tensor's largest (1e-6 of it), not only to the element.
    for (const auto& [name, mine, theirs] : {std::tuple{"exp_avg", full.moments[i].first, s.exp_avg()},
                                              std::tuple{"exp_avg_sq", full.moments[i].second, s.exp_avg_sq()}}) {
      const double scale = theirs.abs().max().item<double>();
      EXPECT_TRUE(torch::allclose(mine, theirs, 1e-6, 1e-6 * scale))
          << name << " " << i << ": largest difference " << (mine - theirs).abs().max().item<double>() << " of "
          << scale;
    }
  }
}

// ZeRO-2 against the replicated AdamW, two backward passes per step (gradient accumulation): each
// pass is reduce-scattered into the chunks as it ends (finalize() after each), every .grad() let go
// as its bucket takes it; the sharded copy steps what the chunks accumulated. After 3 steps the
// weights agree with AdamW's on the summed gradients as ZeRO-1's do.
void zero2_scenario(const DistContext& ctx) {
  auto sharded = make_model(), replicated = make_model();
  BucketedAllReduce gradients(ctx, 64.0 / (1024 * 1024), AllReduceAlgorithm::kBuiltin,
                              GradientReduction::kShardedGradients);
  gradients.attach(*sharded);
  EXPECT_TRUE(gradients.reduces_every_batch());
  EXPECT_GE(gradients.bucket_plan().size(), 2u);
  AdamWHyperparameters options;
  options.lr = 0.05;
  ShardedAdamW zero(gradients, sharded->parameters(), options);
  NaiveAllReduce average(ctx);
  average.attach(*replicated);
  torch::optim::AdamW adamw(replicated->parameters(), torch::optim::AdamWOptions(0.05));
  for (int step = 0; step < 3; ++step) {
    gradients.discard_shards();
    for (auto& p : replicated->parameters()) p.mutable_grad() = at::Tensor();
    for (int pass = 0; pass < 2; ++pass) {
      const at::Tensor input = rank_input(ctx.rank) * (step + 1) * (pass + 1);
      sharded->forward(input).pow(2).sum().backward();
      gradients.finalize();
      for (const auto& p : sharded->parameters()) EXPECT_FALSE(p.grad().defined()) << "step " << step;
      replicated->forward(input).pow(2).sum().backward();
    }
    zero.step();
    average.finalize();
    adamw.step();
  }
  const auto a = sharded->parameters(), b = replicated->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(test_support::agree_after_adamw(a[i], b[i], {0.05, 3}, 1e-5)) << "parameter " << i;
  }
}

DistContext connect_debug_sync(const WorkerEnv& env, std::chrono::milliseconds timeout) {
  DistOptions options = dist_options_for(env, Backend::kGloo);
  options.timeout = timeout;
  options.debug_sync = true;
  return init_process_group(options);
}

// Under --debug_sync, matching collectives of every kind the harness issues go through with
// their results intact, and each is counted as checked.
void debug_sync_agree_scenario(const WorkerEnv& env) {
  const DistContext ctx = connect_debug_sync(env, std::chrono::seconds(60));
  const auto* checked = dynamic_cast<const DebugSyncBackend*>(ctx.group.get());
  ASSERT_NE(checked, nullptr);
  const uint64_t before = checked->checked();
  at::Tensor x = torch::full({3}, static_cast<double>(ctx.rank + 1));
  all_reduce_sum(ctx, x);
  EXPECT_TRUE(torch::equal(x, torch::full({3}, 3.0)));
  std::vector<at::Tensor> b{torch::full({2}, static_cast<double>(ctx.rank + 5))};
  ctx.group->broadcast(b)->wait();
  EXPECT_TRUE(torch::equal(b[0], torch::full({2}, 5.0)));
  std::vector<std::vector<at::Tensor>> out{{torch::zeros({1}), torch::zeros({1})}};
  std::vector<at::Tensor> in{torch::full({1}, static_cast<double>(ctx.rank))};
  ctx.group->allgather(out, in)->wait();
  EXPECT_EQ(out[0][1].item<float>(), 1.0f);
  barrier(ctx);
  EXPECT_EQ(checked->checked() - before, 4u);
}

// Rank 0 all-reduces 4 floats while rank 1 all-reduces 5: instead of reducing mismatched
// buffers, both ranks fail at that collective with both ranks' views.
void debug_sync_mismatch_scenario(const WorkerEnv& env) {
  const DistContext ctx = connect_debug_sync(env, std::chrono::seconds(60));
  at::Tensor agreed = torch::ones({2});
  all_reduce_sum(ctx, agreed);
  at::Tensor x = torch::ones({ctx.rank == 0 ? 4 : 5});
  try {
    all_reduce_sum(ctx, x);
    ADD_FAILURE() << "the mismatched all-reduce went through";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("issue different collectives at #"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0: #"), std::string::npos) << what;
    EXPECT_NE(what.find("allreduce(SUM) float32[4]"), std::string::npos) << what;
    EXPECT_NE(what.find("allreduce(SUM) float32[5]"), std::string::npos) << what;
    std::printf("rank %d: %s\n", ctx.rank, what.c_str());
  }
}

// Rank 1 skips a collective rank 0 issues (and lingers past the timeout): rank 0 fails after
// the timeout, naming rank 1 as the one that never reached it.
void debug_sync_missing_scenario(const WorkerEnv& env) {
  const DistContext ctx = connect_debug_sync(env, std::chrono::seconds(2));
  if (ctx.rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(4));
    return;
  }
  at::Tensor x = torch::ones({3});
  try {
    all_reduce_sum(ctx, x);
    ADD_FAILURE() << "the all-reduce rank 1 never issued went through";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0 of the world group waited before collective #0 allreduce(SUM) float32[3] "
                        "for rank 1, which never reached it within 2 s"),
              std::string::npos)
        << what;
  }
}

// Elastic scenarios over 3 processes: rank 1 is lost before the first all-reduce (killed, or
// stopped by SIGSTOP past the collective timeout); ranks 0 and 2 see the all-reduce fail, agree
// on generation 1 through the launcher's store and all-reduce again over their new group. A
// stopped rank 1, continued afterwards, is refused as a process of a dead generation.
void elastic_scenario(const WorkerEnv& env, bool stop) {
  DistOptions options = dist_options_for(env, Backend::kGloo);
  options.timeout = std::chrono::seconds(3);
  const DistContext world = init_process_group(options);
  const Generation first{0, {0, 1, 2}, {0, 1, 2}, {}};
  const std::string scenario = stop ? "elastic_stop" : "elastic_kill";
  if (env.rank == 1) {
    std::printf("scenario %s passed on rank 1\n", scenario.c_str());  // its part: to be lost
    std::fflush(stdout);
    if (!stop) std::raise(SIGKILL);
    const std::string pid = std::to_string(::getpid());
    world.store->set("pid of rank 1", std::vector<uint8_t>(pid.begin(), pid.end()));
    std::raise(SIGSTOP);
  }
  at::Tensor ones = torch::ones({4});
  try {
    if (env.rank != 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    all_reduce_sum(world, ones);
    if (env.rank != 1) ADD_FAILURE() << "the all-reduce went through without rank 1";
    return;
  } catch (const std::exception& e) {
    std::printf("rank %d: the all-reduce failed: %.120s\n", env.rank, e.what());
  }
  Generation next;
  try {
    // Longer than the collective timeout: a survivor blocked in the all-reduce with the other
    // survivor (rather than the lost rank) learns of the loss only when it times out.
    next = agree_next_generation(*world.store, first, env.rank, std::chrono::seconds(6));
  } catch (const DeadGenerationError& e) {
    ASSERT_EQ(env.rank, 1) << e.what();
    std::printf("rank 1 refused: %s\n", e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
  ASSERT_NE(env.rank, 1) << "the stopped rank was taken back";
  EXPECT_EQ(next.number, 1);
  EXPECT_EQ(next.members, (std::vector<int>{0, 2}));
  const DistContext regrouped = connect_generation(world, next, next.members, env.rank, options);
  EXPECT_EQ(regrouped.rank, env.rank == 0 ? 0 : 1);
  EXPECT_EQ(regrouped.world_size, 2);
  at::Tensor again = torch::ones({4});
  all_reduce_sum(regrouped, again);
  EXPECT_TRUE(torch::equal(again, torch::full({4}, 2.0f)));
  if (stop && env.rank == 0) {  // rank 1 comes back, and finds its generation gone
    const std::vector<uint8_t> pid = world.store->get("pid of rank 1");
    ::kill(std::stoi(std::string(pid.begin(), pid.end())), SIGCONT);
  }
}

TEST(DpWorker, Run) {
  const char* scenario_text = std::getenv(testing::kWorkerVariable);
  if (scenario_text == nullptr) GTEST_SKIP() << "only run as a worker by the launcher tests";
  const std::string scenario = scenario_text;
  const auto env = worker_env_from_environment();
  ASSERT_TRUE(env.has_value()) << "a worker needs RANK/WORLD_SIZE from the launcher";
  const int rank = env->rank;

  if (scenario == "echo") {
    std::printf("plain line from a worker\n");
    std::printf("Epoch 0 on Rank %d: Training Time = 1.5, Tokens_per_sec = 10.0\n", rank);
    std::printf("env RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s MASTER_ADDR=%s MASTER_PORT=%s\n",
                std::getenv("RANK"), std::getenv("WORLD_SIZE"), std::getenv("LOCAL_RANK"),
                std::getenv("MASTER_ADDR"), std::getenv("MASTER_PORT"));
    std::printf("scenario echo passed on rank %d\n", rank);  // _Exit below skips the report at the end
    std::printf("partial line without newline");
    std::fflush(stdout);
    std::fprintf(stderr, "a warning on stderr\n");
    std::_Exit(0);
  } else if (scenario == "fail") {  // rank 1 exits with status 3, the others would run on
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::_Exit(3);
    }
    sleep_then_exit(60);
  } else if (scenario == "sigkill") {  // rank 1 is killed mid-run, leaving a file in its TMPDIR
    const char* scratch = std::getenv("TMPDIR");
    ASSERT_NE(scratch, nullptr) << "the launcher gives its workers a TMPDIR";
    std::FILE* left = std::fopen((std::string(scratch) + "/left by rank " + std::to_string(rank)).c_str(), "w");
    ASSERT_NE(left, nullptr) << scratch;
    std::fclose(left);
    std::printf("scratch folder %s\n", scratch);
    std::fflush(stdout);
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      std::raise(SIGKILL);
    }
    sleep_then_exit(60);
  } else if (scenario == "stubborn") {  // rank 0 ignores SIGTERM and must be SIGKILLed
    // Handshake, not a delay: rank 1 fails only once rank 0 ignores SIGTERM (a slow start of
    // rank 0 would otherwise let SIGTERM end it and the test see the wrong signal).
    const char* ready = std::getenv("HARNESS_TEST_READY_FILE");
    ASSERT_NE(ready, nullptr) << "the stubborn scenario needs HARNESS_TEST_READY_FILE";
    if (rank == 1) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (::access(ready, F_OK) != 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      std::_Exit(2);
    }
    std::signal(SIGTERM, SIG_IGN);
    std::fclose(std::fopen(ready, "w"));
    sleep_then_exit(60);
  } else if (scenario == "leave_early") {  // rank 0 leaves at once; rank 1 fails later or waits on
    if (rank == 0) std::_Exit(0);
    if (std::getenv("HARNESS_TEST_FAIL_AFTER_MS") != nullptr) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(std::getenv("HARNESS_TEST_FAIL_AFTER_MS"))));
      std::_Exit(1);  // as a rank whose collective timed out waiting for rank 0
    }
    sleep_then_exit(60);
  } else if (scenario == "store_outlives_rank0") {  // rank 0 writes a key and leaves; rank 1 reads it after
    DistOptions options = dist_options_for(*env, Backend::kGloo);
    options.timeout = std::chrono::seconds(5);
    const DistContext ctx = init_process_group(options);
    if (rank == 0) {
      ctx.store->set("written by rank 0", std::vector<uint8_t>{7});
      std::printf("scenario store_outlives_rank0 passed on rank 0\n");  // _Exit skips the report at the end
      std::fflush(stdout);
      std::_Exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // rank 0 is gone by then
    const std::vector<uint8_t> value = ctx.store->get("written by rank 0");
    ASSERT_EQ(value, std::vector<uint8_t>{7});
  } else if (scenario == "elastic_replace") {
    // Rank 1 is lost at once; once rank 0 says it went on without it (as survivors do after their
    // first step without it), the launcher starts its replacement (RANK 1, launch id 2), which
    // tells rank 0 through the store who it is.
    DistOptions options = dist_options_for(*env, Backend::kGloo);
    options.timeout = std::chrono::seconds(20);
    const auto store = connect_rendezvous_store(options).store;
    const char* join_id = std::getenv(kElasticJoinIdVariable);
    if (rank == 1 && join_id == nullptr) {
      std::printf("scenario elastic_replace passed on rank 1\n");  // its part: to be lost
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    if (rank == 1) {
      const std::string text = std::string(join_id) + " for rank " + std::to_string(rank) + " on local rank " +
                               std::to_string(env->local_rank);
      store->set("replacement", std::vector<uint8_t>(text.begin(), text.end()));
      std::printf("replacement %s started\n", join_id);
    } else {
      store->wait({lost_process_key(1)}, std::chrono::seconds(20));
      // Long enough for a replacement started at the loss to have said who it is.
      std::this_thread::sleep_for(std::chrono::seconds(1));
      if (!store->check({"replacement"})) std::printf("no replacement before rank 0 went on\n");
      store->set(recovered_key(1), std::vector<uint8_t>{'1'});
      store->wait({"replacement"}, std::chrono::seconds(20));
      const std::vector<uint8_t> text = store->get("replacement");
      std::printf("rank 0 met replacement %s\n", std::string(text.begin(), text.end()).c_str());
    }
  } else if (scenario == "elastic_kill" || scenario == "elastic_stop") {
    elastic_scenario(*env, scenario == "elastic_stop");
    if (rank == 1) return;  // its line was printed before it was lost
  } else if (scenario == "sleep") {
    std::printf("ready on rank %d\n", rank);  // the launcher tests signal only after both
    std::fflush(stdout);
    sleep_then_exit(60);
  } else if (scenario == "allreduce") {
    DistContext ctx = connect(*env);
    EXPECT_EQ(ctx.backend, Backend::kGloo);
    // Rank r contributes (r + 1) * [0, 1, ..., n-1]; the sum is (1 + ... + N) * [0, ..., n-1].
    at::Tensor t = torch::arange(1000, torch::kFloat32) * (rank + 1);
    all_reduce_sum(ctx, t);
    const double factor = env->world_size * (env->world_size + 1) / 2.0;
    EXPECT_TRUE(torch::equal(t, torch::arange(1000, torch::kFloat32) * factor));
    // A non-contiguous tensor goes through a contiguous buffer and lands back in place.
    at::Tensor m = torch::ones({4, 6}).t() * (rank + 1);
    all_reduce_sum(ctx, m);
    EXPECT_TRUE(torch::equal(m, torch::full({6, 4}, factor)));
    barrier(ctx);
  } else if (scenario == "naive") {
    DistContext ctx = connect(*env);
    auto model = make_model();
    model->forward(rank_input(rank)).pow(2).sum().backward();
    const auto sync = make_gradient_synchronizer(GradientSyncKind::kNaive, ctx);
    sync->attach(*model);
    sync->finalize();
    // Expected: the mean of every rank's gradients, computed here without communication.
    std::vector<at::Tensor> expected;
    for (int r = 0; r < env->world_size; ++r) {
      const auto g = local_gradients(r);
      if (expected.empty()) {
        expected = g;
      } else {
        for (size_t i = 0; i < g.size(); ++i) expected[i] = expected[i] + g[i];
      }
    }
    std::vector<std::pair<std::string, at::Tensor>> named;
    const auto params = model->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor want = expected[i] / env->world_size;
      EXPECT_TRUE(torch::allclose(params[i].value().grad(), want, 1e-5, 1e-6))
          << params[i].key() << ": got " << params[i].value().grad() << " want " << want;
      named.emplace_back(params[i].key(), params[i].value().grad());
    }
    const char* dir = std::getenv("HARNESS_TEST_GRAD_DIR");
    ASSERT_NE(dir, nullptr);
    save_tensor_dict_pth(std::string(dir) + "/model" + std::to_string(rank) + "_gradients.pth",
                         named);
  } else if (scenario == "bucketed") {
    // Bucketed and naive averaging of two identical models over three steps (the last with two
    // backward calls) give the same gradients; an unused parameter stays without a gradient.
    DistContext ctx = connect(*env);
    auto make = [] {
      torch::manual_seed(11);
      return torch::nn::Sequential(torch::nn::Linear(5, 16), torch::nn::Tanh(),
                                   torch::nn::Linear(16, 16), torch::nn::Tanh(),
                                   torch::nn::Linear(16, 3));
    };
    auto model_a = make(), model_b = make();
    torch::nn::Linear unused_a(3, 3), unused_b(3, 3);
    auto params_a = model_a->parameters(), params_b = model_b->parameters();
    for (const auto& p : unused_a->parameters()) params_a.push_back(p);
    for (const auto& p : unused_b->parameters()) params_b.push_back(p);
    BucketedAllReduce bucketed(ctx, /*bucket_cap_mb=*/400.0 / (1024 * 1024));  // 400 bytes
    bucketed.attach(params_a);
    EXPECT_GE(bucketed.bucket_plan().size(), 3u);
    NaiveAllReduce naive(ctx);
    naive.attach(params_b);
    for (int step = 0; step < 3; ++step) {
      for (auto* params : {&params_a, &params_b}) {
        for (auto& p : *params) p.mutable_grad() = at::Tensor();  // zero_grad(set_to_none)
      }
      const int n_backward = step == 2 ? 2 : 1;
      for (int k = 0; k < n_backward; ++k) {
        const at::Tensor x = rank_input(rank) * (step + 1) - 0.1 * k;
        model_a->forward(x).pow(2).sum().backward();
        model_b->forward(x).pow(2).sum().backward();
      }
      bucketed.finalize();
      naive.finalize();
      // The unused parameters, registered last, sit in the first bucket: in the first step they
      // hold every bucket back to finalize(); from then on they are known and no longer do.
      if (step == 0) {
        EXPECT_EQ(bucketed.launched_during_backward(), 0);
      } else {
        EXPECT_EQ(bucketed.launched_during_backward(),
                  static_cast<int64_t>(bucketed.bucket_plan().size()))
            << "step " << step;
      }
      for (size_t i = 0; i < params_a.size(); ++i) {
        const at::Tensor& ga = params_a[i].grad();
        const at::Tensor& gb = params_b[i].grad();
        ASSERT_EQ(ga.defined(), gb.defined()) << "parameter " << i << " step " << step;
        if (ga.defined()) {
          EXPECT_TRUE(torch::allclose(ga, gb, 1e-6, 1e-7)) << "parameter " << i << " step " << step;
        }
      }
      EXPECT_FALSE(unused_a->weight.grad().defined());
    }
  } else if (scenario == "bucketed_unused_on_one_rank" || scenario == "naive_unused_on_one_rank") {
    unused_on_one_rank_scenario(connect(*env), scenario.substr(0, scenario.find('_')));
  } else if (scenario == "zero") {
    zero_scenario(connect(*env));
  } else if (scenario == "zero2") {
    zero2_scenario(connect(*env));
  } else if (scenario == "debug_sync_agree") {
    debug_sync_agree_scenario(*env);
  } else if (scenario == "debug_sync_mismatch") {
    debug_sync_mismatch_scenario(*env);
  } else if (scenario == "debug_sync_missing") {
    debug_sync_missing_scenario(*env);
  } else if (scenario == "ring") {
    ring_scenario(connect(*env));
  } else if (scenario == "ring_grad_sync") {
    ring_grad_sync_scenario(connect(*env));
  } else {
    FAIL() << "unknown scenario " << scenario;
  }
  if (!::testing::Test::HasFailure()) {
    std::printf("scenario %s passed on rank %d\n", scenario.c_str(), env->rank);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace harness::data_parallel
