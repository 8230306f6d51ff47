// Data parallelism with CUDA tensors. Two ranks on one GPU over Gloo (two processes, this binary
// run again as the ranks): all-reduces of CUDA tensors, and a GPT-2 step whose gradients, averaged
// by the original's per-parameter all-reduce and by the bucketed one, equal the whole batch's on one
// rank and are bit-identical between the ranks. One rank over NCCL in this process. NCCL refuses
// two ranks on one GPU (each rank of a communicator needs its own device), so its two-rank case
// needs two GPUs, and then runs the same scenario over cuda:0 and cuda:1. Tensor parallelism with
// T = 2 on one GPU over Gloo: the split model against the unsplit one.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "cuda_test_support.h"
#include "harness/data_parallel/grad_sync.h"
#include "harness/data_parallel/launcher.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/gpt2.h"
#include "harness/tensor_parallel/group.h"
#include "harness/train/step/train_step.h"

namespace harness::data_parallel {
namespace {

using cuda_testing::Snapshot;

// The rank's GPU: cuda:0 for every rank when `shared`, else cuda:<rank>.
Device device_of(const WorkerEnv& env, bool shared) { return Device::cuda(shared ? 0 : env.local_rank); }

DistContext connect(const WorkerEnv& env, Backend backend, const Device& device) {
  DistOptions options = dist_options_for(env, backend, device);
  options.timeout = std::chrono::seconds(60);  // a collective that hangs fails the test instead
  return init_process_group(options);
}

// Sums of CUDA tensors, contiguous and not, in place on the rank's device.
void check_all_reduce(const DistContext& ctx) {
  const auto on = torch::TensorOptions().device(ctx.device.torch_device());
  at::Tensor t = torch::full({1000}, static_cast<float>(ctx.rank + 1), on);
  all_reduce_sum(ctx, t);
  const float expected = static_cast<float>(ctx.world_size * (ctx.world_size + 1) / 2);
  EXPECT_TRUE(t.is_cuda());
  EXPECT_TRUE(torch::equal(t.cpu(), torch::full({1000}, expected))) << "rank " << ctx.rank;
  at::Tensor base = torch::arange(12, on.dtype(torch::kFloat32)).reshape({3, 4}) * (ctx.rank + 1);
  at::Tensor transposed = base.t();  // not contiguous
  all_reduce_sum(ctx, transposed);
  const at::Tensor want = (torch::arange(12, torch::kFloat32).reshape({3, 4}) * expected).t();
  EXPECT_TRUE(torch::equal(transposed.cpu(), want)) << "rank " << ctx.rank << ": non-contiguous";
}

// One GPT-2 step per synchronizer: each rank trains on its share of the rows, the averaged
// gradients equal one rank's gradients of the whole batch, and are the same bits on every rank
// (their sum over the ranks is exactly world_size times this rank's).
void check_gpt2_step(const DistContext& ctx) {
  cuda_testing::ieee_fp32_matmuls();
  const c10::Device device = ctx.device.torch_device();
  const model::GPT2Config config = cuda_testing::config_of("gpt2-tiny", 0, 0.0);
  const int64_t rows_per_rank = 4;
  const data::Batch whole = cuda_testing::make_batches(config, 1, rows_per_rank * ctx.world_size, 24, true).front();
  const data::Batch mine = cuda_testing::rows_of(whole, ctx.rank * rows_per_rank, (ctx.rank + 1) * rows_per_rank);

  model::GPT2LMHeadModel reference = cuda_testing::make_model(config);
  reference->to(device);
  train::GPT2TrainStep alone(reference, 1e-3);
  alone.set_training(true);
  alone.step(cuda_testing::on_device(whole, device));
  const Snapshot expected = cuda_testing::gradients_of(*reference);

  for (const std::string kind : {"naive", "bucketed"}) {
    // A small bucket cap: several buckets, reduced as backward produces them.
    std::unique_ptr<GradientSynchronizer> sync = make_gradient_synchronizer(parse_gradient_sync(kind), ctx, /*bucket_cap_mb=*/0.1);
    model::GPT2LMHeadModel model = cuda_testing::make_model(config);
    model->to(device);
    train::GPT2TrainStep step(model, 1e-3, sync.get());
    step.set_training(true);
    step.step(cuda_testing::on_device(mine, device));
    const std::string label = kind + " on rank " + std::to_string(ctx.rank);
    cuda_testing::expect_close(cuda_testing::gradients_of(*model), expected, cuda_testing::kSameDeviceGradientTolerance,
                               cuda_testing::kGradientNormFloor, label);
    for (const auto& p : model->named_parameters()) {
      const at::Tensor grad = p.value().grad();
      ASSERT_TRUE(grad.defined()) << label << ": no gradient for " << p.key();
      EXPECT_TRUE(grad.is_cuda()) << label << ": " << p.key();
      at::Tensor sum = grad.detach().clone();
      all_reduce_sum(ctx, sum);
      EXPECT_TRUE(torch::equal(sum, grad * static_cast<float>(ctx.world_size)))
          << label << ": " << p.key() << " differs between the ranks";
    }
  }
}

// Tensor parallelism with T = 2 on one GPU over Gloo: the split GPT-2 on cuda:0 equals the
// unsplit one on cuda:0 in logits, gradients (gathered unsplit) and KV-cached greedy tokens.
void check_tensor_parallel(const DistContext& ctx) {
  cuda_testing::ieee_fp32_matmuls();
  const c10::Device device = ctx.device.torch_device();
  const model::GPT2Config config = cuda_testing::config_of("gpt2-tiny", 0, 0.0);
  const data::Batch batch = cuda_testing::on_device(cuda_testing::make_batches(config, 1, 4, 24, true).front(), device);
  torch::manual_seed(5);
  model::GPT2LMHeadModel whole(config);
  whole->to(device);
  torch::manual_seed(5);  // the same draws: the split model holds the unsplit one's slices
  model::GPT2LMHeadModel split(config, tensor_parallel::make_tensor_parallel_group(ctx));
  split->to(device);
  const at::Tensor want = whole->forward(batch.input_ids);
  const at::Tensor got = split->forward(batch.input_ids);
  EXPECT_TRUE(got.is_cuda());
  EXPECT_LE(cuda_testing::relative_error(got.detach().cpu(), want.detach().cpu()), cuda_testing::kSameDeviceGradientTolerance)
      << "logits on rank " << ctx.rank;
  want.pow(2).mean().backward();
  got.pow(2).mean().backward();
  cuda_testing::Snapshot split_gradients;
  for (const auto& [name, grad] : split->full_gradients()) split_gradients[name] = grad;
  cuda_testing::expect_close(split_gradients, cuda_testing::gradients_of(*whole), cuda_testing::kSameDeviceGradientTolerance,
                             cuda_testing::kGradientNormFloor, "tensor parallel on rank " + std::to_string(ctx.rank));
  torch::NoGradGuard no_grad;
  model::KVCache a, b;
  at::Tensor next_a = batch.input_ids.narrow(0, 0, 1).narrow(1, 0, 4), next_b = next_a;
  for (int i = 0; i < 6; ++i) {
    const at::Tensor la = whole->forward_cached(next_a, a), lb = split->forward_cached(next_b, b);
    next_a = la.select(1, la.size(1) - 1).argmax(-1, true);
    next_b = lb.select(1, lb.size(1) - 1).argmax(-1, true);
    EXPECT_EQ(next_a.item<int64_t>(), next_b.item<int64_t>()) << "generated token " << i << " on rank " << ctx.rank;
  }
}

TEST(CudaWorker, Run) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const char* scenario_text = std::getenv(cuda_testing::kWorkerVariable.c_str());
  if (scenario_text == nullptr) GTEST_SKIP() << "only run as a rank by the multi-process CUDA tests";
  const std::string scenario = scenario_text;
  const std::optional<WorkerEnv> env = worker_env_from_environment();
  ASSERT_TRUE(env.has_value()) << "started without RANK/WORLD_SIZE";
  if (scenario == "gloo_one_gpu" || scenario == "nccl_two_gpus") {
    const bool shared = scenario == "gloo_one_gpu";
    const Device device = device_of(*env, shared);
    DistContext ctx = connect(*env, shared ? Backend::kGloo : Backend::kNccl, device);
    check_all_reduce(ctx);
    check_gpt2_step(ctx);
    barrier(ctx);
  } else if (scenario == "tensor_parallel_one_gpu") {
    DistContext ctx = connect(*env, Backend::kGloo, Device::cuda(0));
    check_tensor_parallel(ctx);
    barrier(ctx);
  } else {
    FAIL() << "unknown scenario " << scenario;
  }
  if (!::testing::Test::HasFailure()) {
    std::printf("scenario %s passed on rank %d\n", scenario.c_str(), env->rank);
    std::fflush(stdout);
  }
}

TEST(CudaDataParallel, TwoRanksOnOneGpuOverGlooWithCudaTensors) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const auto run = cuda_testing::run_scenario("gloo_one_gpu", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

TEST(CudaTensorParallel, TwoRanksOnOneGpuOverGlooSplitGpt2EqualsUnsplit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const auto run = cuda_testing::run_scenario("tensor_parallel_one_gpu", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

TEST(CudaDataParallel, OneRankOverNccl) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  WorkerEnv env;
  env.master_port = test_workers::free_port();
  DistContext ctx = connect(env, Backend::kNccl, Device::cuda(0));
  EXPECT_EQ(ctx.backend, Backend::kNccl);
  check_all_reduce(ctx);
  check_gpt2_step(ctx);
  barrier(ctx);
}

TEST(CudaDataParallel, TwoRanksOnTwoGpusOverNccl) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  if (cuda_testing::gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs; NCCL refuses two ranks on one GPU";
  const auto run = cuda_testing::run_scenario("nccl_two_gpus", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

}  // namespace
}  // namespace harness::data_parallel
