// The worker side of the multi-process tests: skipped in a normal run; when the launcher in
// another test starts this binary with HARNESS_TEST_WORKER=<scenario>, it plays that scenario.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "harness/data_parallel/bucketed_all_reduce.h"
#include "harness/data_parallel/checkpoint_io.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "test_support.h"

namespace harness::data_parallel {
namespace {

[[noreturn]] void sleep_then_exit(int seconds) {
  for (int i = 0; i < seconds * 10; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::_Exit(0);
}

DistContext connect(const WorkerEnv& env) {
  DistOptions options;
  options.rank = env.rank;
  options.world_size = env.world_size;
  options.local_rank = env.local_rank;
  options.master_addr = env.master_addr;
  options.master_port = env.master_port;
  options.backend = "gloo";
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
  } else if (scenario == "sigkill") {  // rank 1 is killed mid-run
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      std::raise(SIGKILL);
    }
    sleep_then_exit(60);
  } else if (scenario == "stubborn") {  // rank 0 ignores SIGTERM and must be SIGKILLed
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::_Exit(2);
    }
    std::signal(SIGTERM, SIG_IGN);
    sleep_then_exit(60);
  } else if (scenario == "sleep") {
    sleep_then_exit(60);
  } else if (scenario == "allreduce") {
    DistContext ctx = connect(*env);
    EXPECT_EQ(ctx.backend, "gloo");
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
    const auto sync = make_gradient_synchronizer("naive", ctx);
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
  } else {
    FAIL() << "unknown scenario " << scenario;
  }
}

}  // namespace
}  // namespace harness::data_parallel
