// Pipe: output and gradients equal the plain module's (a5_2_2), failures surface on the caller,
// threads are joined, the trace shows the GPipe order, the engine's workers run the clock cycles,
// and each task draws from a random stream of its own.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include "harness/model/dropout.h"
#include "harness/pipeline/gpipe_plan.h"
#include "harness/pipeline/pipe.h"
#include "harness/pipeline/schedule.h"
#include "test_support.h"
#include "harness/pipeline/with_device.h"

namespace harness::pipeline {
namespace {

using testing::thread_count;
using testing::thread_count_settled;
using testing::thread_count_stable;

// The original's model: Linear - Sigmoid on the first device, Linear - Sigmoid on the second.
torch::nn::Sequential two_device_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(WithDevice(torch::nn::Linear(8, 16), Device::cpu(0)),
                               WithDevice(torch::nn::Sigmoid(), Device::cpu(0)),
                               WithDevice(torch::nn::Linear(16, 4), Device::cpu(1)),
                               WithDevice(torch::nn::Sigmoid(), Device::cpu(1)));
}

std::map<std::string, torch::Tensor> gradients_of(torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> grads;
  for (const auto& p : module.named_parameters()) grads[p.key()] = p.value().grad().clone();
  return grads;
}

TEST(Pipe, a5_2_2_OutputEqualsThePlainModule) {
  torch::nn::Sequential model = two_device_model();
  Pipe pipe(model, 1, {/*threads_per_device=*/1});
  torch::NoGradGuard no_grad;
  for (int64_t batch : {1, 16, 32, 64}) {
    const auto x = torch::randn({batch, 8});
    const auto expected = model->forward(x);
    for (int64_t split : {1, 2, 4, 8, 16}) {
      pipe.set_split_size(split);
      const auto y = pipe.forward(x);
      ASSERT_EQ(y.sizes(), expected.sizes());
      EXPECT_TRUE(torch::allclose(y, expected, 1e-6, 1e-6)) << "batch " << batch << " split " << split;
    }
  }
}

class PipeGradients : public ::testing::TestWithParam<bool> {};

TEST_P(PipeGradients, a5_2_2_GradientsEqualThePlainModule) {
  const bool pipelined_backward = GetParam();
  torch::nn::Sequential model = two_device_model();
  const auto x = torch::randn({32, 8});
  const auto target = torch::randn({32, 4});

  auto x_plain = x.clone().requires_grad_();
  torch::mse_loss(model->forward(x_plain), target).backward();
  const auto expected = gradients_of(*model);
  model->zero_grad();

  PipeOptions options;
  options.threads_per_device = 1;
  options.pipelined_backward = pipelined_backward;
  Pipe pipe(model, 8, options);
  auto x_pipe = x.clone().requires_grad_();
  const auto y = pipe.forward(x_pipe);
  ASSERT_TRUE(y.requires_grad());
  torch::mse_loss(y, target).backward();
  for (const auto& [name, grad] : gradients_of(*model)) {
    EXPECT_TRUE(torch::allclose(grad, expected.at(name), 1e-6, 1e-6)) << name;
  }
  EXPECT_TRUE(torch::allclose(x_pipe.grad(), x_plain.grad(), 1e-6, 1e-6));
}

INSTANTIATE_TEST_SUITE_P(BothBackwards, PipeGradients, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Pipelined" : "Engine"; });

TEST(Pipe, GradientsWithoutInputGradAndUnevenLastMicroBatch) {
  torch::nn::Sequential model = two_device_model();
  const auto x = torch::randn({13, 8});
  model->forward(x).sum().backward();
  const auto expected = gradients_of(*model);
  model->zero_grad();
  Pipe pipe(model, 4, {1});
  pipe.forward(x).sum().backward();
  for (const auto& [name, grad] : gradients_of(*model)) {
    EXPECT_TRUE(torch::allclose(grad, expected.at(name), 1e-6, 1e-6)) << name;
  }
}

TEST(Pipe, NoGradForwardBuildsNoGraph) {
  torch::nn::Sequential model = two_device_model();
  Pipe pipe(model, 2, {1});
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(pipe.forward(torch::randn({4, 8})).requires_grad());
}

struct FailOnCallImpl : torch::nn::Module {
  explicit FailOnCallImpl(int fail_on) : fail_on(fail_on) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (calls++ == fail_on) throw std::runtime_error("layer exploded on call " + std::to_string(fail_on));
    return x;
  }
  std::atomic<int> calls{0};
  int fail_on;
};
TORCH_MODULE(FailOnCall);

TEST(Pipe, a5_2_2_FailingTaskSurfacesItsMessageAndLeavesNoThread) {
  {
    Pipe warm_up(two_device_model(), 2, {1});  // lazily created process-wide threads, if any
    warm_up.forward(torch::randn({4, 8}, torch::requires_grad())).sum().backward();
  }
  const size_t before = thread_count_stable();
  {
    torch::nn::Sequential model(WithDevice(torch::nn::Linear(8, 8), Device::cpu(0)),
                                WithDevice(FailOnCall(1), Device::cpu(1)));
    Pipe pipe(model, 2, {1});
    EXPECT_EQ(thread_count(), before + 2);
    try {
      pipe.forward(torch::randn({8, 8}));
      FAIL() << "expected the layer's exception";
    } catch (const std::exception& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("layer exploded on call 1"), std::string::npos) << message;
      EXPECT_NE(message.find("micro-batch 1, partition 1 on cpu:1"), std::string::npos) << message;
    }
  }
  EXPECT_EQ(thread_count_settled(before), before);
}

TEST(Pipe, a5_2_2_TwoPipesAtOnceAndDestructorsJoin) {
  const size_t before = thread_count_stable();
  {
    torch::nn::Sequential a = two_device_model();
    torch::nn::Sequential b = two_device_model();
    auto pipe_a = std::make_shared<Pipe>(a, 2, PipeOptions{1});
    auto pipe_b = std::make_shared<Pipe>(b, 3, PipeOptions{1});
    EXPECT_EQ(thread_count(), before + 4);
    const auto x = torch::randn({16, 8});
    torch::Tensor ya, yb;
    std::thread ta([&] {
      for (int k = 0; k < 20; ++k) ya = pipe_a->forward(x);
    });
    std::thread tb([&] {
      for (int k = 0; k < 20; ++k) yb = pipe_b->forward(x);
    });
    ta.join();
    tb.join();
    EXPECT_TRUE(torch::allclose(ya, yb, 1e-6, 1e-6));
    pipe_a.reset();
    EXPECT_EQ(thread_count_settled(before + 2), before + 2);
  }
  EXPECT_EQ(thread_count_settled(before), before);
}

TEST(Pipe, BackwardAfterThePipeIsGoneIsAClearError) {
  torch::nn::Sequential model = two_device_model();
  torch::Tensor y;
  {
    Pipe pipe(model, 2, {1, nullptr, /*pipelined_backward=*/true});
    y = pipe.forward(torch::randn({4, 8}));
  }
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Pipe was destroyed"), std::string::npos) << e.what();
  }
}

TEST(Pipe, RejectsBadSplitSizeAndEmptyInput) {
  EXPECT_THROW(Pipe(two_device_model(), 0, {1}), std::invalid_argument);
  Pipe pipe(two_device_model(), 2, {1});
  EXPECT_THROW(pipe.forward(torch::randn({0, 8})), c10::Error);
}

TEST(Pipe, TraceShowsEveryTaskInGPipeOrder) {
  Tracer tracer;
  PipeOptions options;
  options.threads_per_device = 1;
  options.tracer = &tracer;
  options.pipelined_backward = true;
  Pipe pipe(two_device_model(), 2, options);
  pipe.forward(torch::randn({8, 8}, torch::requires_grad())).sum().backward();

  // (phase, i, j) -> slice
  std::map<std::tuple<std::string, int64_t, int64_t>, Tracer::Slice> by_task;
  for (const auto& slice : tracer.slices()) {
    int64_t i = -1, j = -1;
    for (const auto& [key, value] : slice.args) {
      if (key == "micro_batch") i = std::get<int64_t>(value);
      if (key == "partition") j = std::get<int64_t>(value);
    }
    EXPECT_EQ(slice.track, j == 0 ? "cpu:0" : "cpu:1");
    by_task[{slice.name, i, j}] = slice;
  }
  ASSERT_EQ(by_task.size(), 16u);  // 4 micro-batches x 2 partitions x forward/backward
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_LE((by_task[{"forward", i, 0}].end_us), (by_task[{"forward", i, 1}].start_us));
    EXPECT_LE((by_task[{"backward", i, 1}].end_us), (by_task[{"backward", i, 0}].start_us));
    EXPECT_LE((by_task[{"forward", 3, 1}].end_us), (by_task[{"backward", i, 1}].start_us));
  }
  for (int64_t i = 0; i + 1 < 4; ++i) {
    EXPECT_LE((by_task[{"backward", i + 1, 1}].end_us), (by_task[{"backward", i, 1}].start_us));
  }
}

// The clock cycles are the engine's: each lane ran its partition's forwards in the order of the
// engine's GPipe plan, which is that partition's row of the clock table, each micro-batch after the
// previous partition had finished it; and that plan, run in unit time, is clock_cycles itself.
TEST(Pipe, ItsClockCyclesRunOnTheEnginesWorkers) {
  Tracer tracer;
  PipeOptions options;
  options.threads_per_device = 1;
  options.tracer = &tracer;
  torch::manual_seed(0);
  torch::nn::Sequential model(WithDevice(torch::nn::Linear(8, 8), Device::cpu(0)),
                              WithDevice(torch::nn::Linear(8, 8), Device::cpu(1)),
                              WithDevice(torch::nn::Linear(8, 4), Device::cpu(2)));
  Pipe pipe(model, 2, options);
  const auto x = torch::randn({8, 8});
  EXPECT_TRUE(torch::allclose(pipe.forward(x), model->forward(x), 1e-6, 1e-6));

  const int m = 4, n = 3;
  const P2PPlan& plan = gpipe_plan_halves(m, n).forward;
  EXPECT_EQ(unit_time_cycles(plan), clock_cycles(m, n));
  const ClockTable table = clock_table(clock_cycles(m, n), n);
  std::map<std::string, std::vector<Tracer::Slice>> by_track;
  std::map<std::pair<int64_t, int64_t>, Tracer::Slice> by_task;
  for (const auto& slice : tracer.slices()) {
    ASSERT_EQ(slice.name, "forward");  // the autograd engine runs this Pipe's backward
    by_track[slice.track].push_back(slice);
    by_task[{std::get<int64_t>(slice.args.at(0).second), std::get<int64_t>(slice.args.at(1).second)}] = slice;
  }
  ASSERT_EQ(by_track.size(), 3u);
  for (int j = 0; j < n; ++j) {
    std::vector<Tracer::Slice>& slices = by_track["cpu:" + std::to_string(j)];
    std::sort(slices.begin(), slices.end(), [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
    std::vector<Action> ran, row;
    for (const auto& slice : slices) {
      EXPECT_EQ(slice.args.at(1).first, "partition");
      ran.push_back(Action::forward(static_cast<int>(std::get<int64_t>(slice.args.at(0).second)),
                                    static_cast<int>(std::get<int64_t>(slice.args.at(1).second))));
    }
    for (int i : table[j]) {
      if (i != kIdle) row.push_back(Action::forward(i, j));
    }
    EXPECT_EQ(ran, plan.schedule.per_device[j]) << "partition " << j;
    EXPECT_EQ(ran, row) << "partition " << j;
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 1; j < n; ++j) EXPECT_LE((by_task[{i, j - 1}].end_us), (by_task[{i, j}].start_us));
  }
}

// Harness dropout draws from the running task's stream: the (forward, micro-batch, partition)
// streams of the Pipe's seed, which torch::manual_seed fixes, whatever the threads' timing.
struct StreamDropoutImpl : torch::nn::Module {
  StreamDropoutImpl() { drop = register_module("drop", torch::nn::Dropout(0.5)); }
  torch::Tensor forward(const torch::Tensor& x) { return model::dropout(x, drop); }
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(StreamDropout);

TEST(Pipe, EachTaskDrawsFromARandomStreamOfItsOwn) {
  auto make = [] {
    return torch::nn::Sequential(WithDevice(StreamDropout(), Device::cpu(0)),
                                 WithDevice(StreamDropout(), Device::cpu(1)));
  };
  const auto x = torch::ones({16, 64});
  torch::manual_seed(21);
  Pipe a(make(), 2, {1});
  const auto first = a.forward(x);
  const auto second = a.forward(x);
  torch::manual_seed(21);
  Pipe b(make(), 2, {1});
  EXPECT_TRUE(torch::equal(b.forward(x), first));
  EXPECT_TRUE(torch::equal(b.forward(x), second));
  EXPECT_FALSE(torch::equal(first, second));  // each forward has streams of its own
  // Micro-batches (rows 0-1 against 2-3) and partitions draw different masks.
  EXPECT_FALSE(torch::equal(first.slice(0, 0, 2), first.slice(0, 2, 4)));
  const auto kept = (first != 0).to(torch::kFloat32).mean().item<double>();
  EXPECT_NEAR(kept, 0.25, 0.05);  // two independent halvings
}

// Identity whose forward and backward each take `millis` of wall time, so that overlap between
// the two lanes shows in the trace whatever the machine's load.
struct SlowIdentity : torch::autograd::Function<SlowIdentity> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t millis) {
    ctx->saved_data["millis"] = millis;
    std::this_thread::sleep_for(std::chrono::milliseconds(millis));
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ctx->saved_data["millis"].toInt()));
    return {grads[0], torch::Tensor()};
  }
};
struct SlowLayerImpl : torch::nn::Module {
  SlowLayerImpl() { weight = register_parameter("weight", torch::ones({4})); }
  torch::Tensor forward(const torch::Tensor& x) { return SlowIdentity::apply(x * weight, 30); }
  torch::Tensor weight;
};
TORCH_MODULE(SlowLayer);

bool overlap(const Tracer::Slice& a, const Tracer::Slice& b) {
  return a.start_us < b.end_us && b.start_us < a.end_us;
}

TEST(Pipe, BothLanesWorkAtOnceInForwardAndPipelinedBackward) {
  Tracer tracer;
  PipeOptions options;
  options.threads_per_device = 1;
  options.tracer = &tracer;
  options.pipelined_backward = true;
  Pipe pipe(torch::nn::Sequential(WithDevice(SlowLayer(), Device::cpu(0)),
                                  WithDevice(SlowLayer(), Device::cpu(1))),
            1, options);
  pipe.forward(torch::ones({2, 4})).sum().backward();
  std::map<std::tuple<std::string, int64_t, int64_t>, Tracer::Slice> by_task;
  for (const auto& slice : tracer.slices()) {
    by_task[{slice.name, std::get<int64_t>(slice.args.at(0).second),
             std::get<int64_t>(slice.args.at(1).second)}] = slice;
  }
  ASSERT_EQ(by_task.size(), 8u);
  // Forward cycle 1 runs (1,0) on cpu:0 with (0,1) on cpu:1; backward cycle 1 (0,1) with (1,0).
  EXPECT_TRUE(overlap(by_task[{"forward", 1, 0}], by_task[{"forward", 0, 1}]));
  EXPECT_TRUE(overlap(by_task[{"backward", 0, 1}], by_task[{"backward", 1, 0}]));
}

struct FailingBackward : torch::autograd::Function<FailingBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("backward exploded");
  }
};
struct FailingBackwardLayerImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return FailingBackward::apply(x); }
};
TORCH_MODULE(FailingBackwardLayer);

TEST(Pipe, FailingBackwardTaskSurfacesFromLossBackward) {
  const size_t before = thread_count_stable();
  {
    Pipe pipe(torch::nn::Sequential(WithDevice(torch::nn::Linear(4, 4), Device::cpu(0)),
                                    WithDevice(FailingBackwardLayer(), Device::cpu(1))),
              2, {1, nullptr, /*pipelined_backward=*/true});
    const auto y = pipe.forward(torch::randn({4, 4}));
    try {
      y.sum().backward();
      FAIL() << "expected the backward's exception";
    } catch (const std::exception& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("backward exploded"), std::string::npos) << message;
      EXPECT_NE(message.find("backward of micro-batch 1, partition 1 on cpu:1"), std::string::npos)
          << message;
    }
  }
  EXPECT_EQ(thread_count_settled(before), before);
}

}  // namespace
}  // namespace harness::pipeline
