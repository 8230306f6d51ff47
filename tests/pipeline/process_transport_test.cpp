// Pipeline stages as processes, in one test process: each schedule device is a thread with a Gloo
// group of its own over a shared store, running its part of the plan through ProcessTransport
// (c10d send/recv), exactly the loop the threaded executor runs. The gradients equal the threaded
// executor's bit for bit, for every schedule and for the ones whose exchanges cross (1F1B,
// interleaved), and a failing stage ends its peers' waits with an error instead of a hang.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "harness/data_parallel/process_group.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/p2p_plan.h"
#include "harness/pipeline/process_transport.h"
#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {
namespace {

constexpr int64_t kRows = 3, kWidth = 8;

// Stage s: y = tanh(x W_s); the last stage returns its micro-batch's share of sum(y^2).
struct Stages {
  std::vector<at::Tensor> weights;
  explicit Stages(int S) {
    torch::manual_seed(5);
    for (int s = 0; s < S; ++s) weights.push_back(torch::randn({kWidth, kWidth}).mul_(0.5).requires_grad_(true));
  }
  StageForward forward(const std::vector<at::Tensor>& inputs) {
    const int S = static_cast<int>(weights.size());
    return [this, &inputs, S](int i, int s, const at::Tensor& input) {
      at::Tensor y = torch::tanh(torch::matmul(s == 0 ? inputs[i] : input, weights[s]));
      return s == S - 1 ? y.pow(2).sum() : y;
    };
  }
};

std::vector<at::Tensor> micro_batches(int M) {
  torch::manual_seed(9);
  std::vector<at::Tensor> out;
  for (int i = 0; i < M; ++i) out.push_back(torch::randn({kRows, kWidth}));
  return out;
}

// Runs `schedule` with one thread per device, each its own Gloo rank of the pipeline group.
// failing_stage >= 0 makes that stage's forward of micro-batch 1 throw. Returns each device's error.
std::vector<std::string> run_as_processes(const TrainingSchedule& schedule, Stages& stages,
                                          const std::vector<at::Tensor>& inputs, std::vector<at::Tensor>& losses,
                                          int failing_stage = -1, bool debug_record = false) {
  const int D = schedule.devices;
  const P2PPlan plan = make_p2p_plan(schedule);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(D);
  losses.assign(schedule.micro_batches, at::Tensor());
  StageForward inner = stages.forward(inputs);
  StageForward forward = [&](int i, int s, const at::Tensor& input) {
    if (s == failing_stage && i == 1) throw std::runtime_error("stage broke on purpose");
    return inner(i, s, input);
  };
  std::vector<std::thread> threads;
  for (int d = 0; d < D; ++d) {
    threads.emplace_back([&, d] {
      try {
        data_parallel::DistOptions options;
        options.timeout = std::chrono::seconds(20);
        auto group = data_parallel::create_backend(data_parallel::Backend::kGloo, store, d, D, options);
        std::optional<P2PDebugRecord> debug;
        if (debug_record) debug = P2PDebugRecord{store};
        ProcessTransport transport(group, Device::cpu(0),
                                   [](const P2PMessage&) { return std::vector<int64_t>{kRows, kWidth}; },
                                   at::kFloat, debug);
        DeviceStepResult part = run_device_steps(plan, d, Device::cpu(0), forward, 7, transport, {}, "rank");
        for (int i = 0; i < schedule.micro_batches; ++i) {
          if (part.losses[i].defined()) losses[i] = part.losses[i];
        }
      } catch (const std::exception& e) {
        errors[d] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(ProcessTransport, EveryScheduleOverSendRecvGivesTheThreadedExecutorsGradientsBitForBit) {
  struct Case {
    const char* name;
    int M, D, V;
  };
  for (const Case& c : {Case{"gpipe", 4, 2, 1}, Case{"1f1b", 4, 2, 1}, Case{"1f1b", 5, 3, 1},
                        Case{"interleaved", 4, 2, 2}, Case{"gpipe", 2, 2, 2}, Case{"1f1b", 3, 4, 1}}) {
    SCOPED_TRACE(std::string(c.name) + " M=" + std::to_string(c.M) + " D=" + std::to_string(c.D) +
                 " V=" + std::to_string(c.V));
    const TrainingSchedule schedule = std::string(c.name) == "interleaved" ? interleaved_schedule(c.M, c.D, c.V)
                                      : std::string(c.name) == "gpipe"     ? gpipe_schedule(c.M, c.D, c.V)
                                                                           : one_f_one_b_schedule(c.M, c.D);
    const std::vector<at::Tensor> inputs = micro_batches(c.M);
    Stages threaded(schedule.stages()), processes(schedule.stages());

    ScheduleExecutor executor(std::vector<Device>(c.D, Device::cpu(0)), ExecutorOptions{1});
    const StepResult expected = executor.run(schedule, threaded.forward(inputs), 7);

    std::vector<at::Tensor> losses;
    const std::vector<std::string> errors = run_as_processes(schedule, processes, inputs, losses);
    for (int d = 0; d < c.D; ++d) ASSERT_EQ(errors[d], "") << "device " << d;
    for (int i = 0; i < c.M; ++i) EXPECT_TRUE(torch::equal(losses[i], expected.losses[i])) << "loss " << i;
    for (int s = 0; s < schedule.stages(); ++s) {
      ASSERT_TRUE(processes.weights[s].grad().defined()) << "stage " << s;
      EXPECT_TRUE(torch::equal(processes.weights[s].grad(), threaded.weights[s].grad())) << "stage " << s;
    }
  }
}

TEST(ProcessTransport, AFailingStageEndsItsPeersWaitsWithAnErrorNamingTheExchange) {
  const TrainingSchedule schedule = one_f_one_b_schedule(4, 2);
  const std::vector<at::Tensor> inputs = micro_batches(4);
  Stages stages(2);
  std::vector<at::Tensor> losses;
  // Device 1's stage fails at micro-batch 1 and its Gloo group goes with its thread; device 0,
  // waiting for a gradient from it, must fail too rather than wait forever.
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> errors = run_as_processes(schedule, stages, inputs, losses, /*failing_stage=*/1);
  EXPECT_NE(errors[1].find("forward of micro-batch 1, stage 1: stage broke on purpose"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("in its exchange #"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("pipeline rank 0 got no answer from pipeline rank 1"), std::string::npos) << errors[0];
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(25));
}

TEST(ProcessTransport, UnderDebugSyncAFailedExchangeSaysWhatThePeerLastPosted) {
  const TrainingSchedule schedule = one_f_one_b_schedule(4, 2);
  const std::vector<at::Tensor> inputs = micro_batches(4);
  Stages stages(2);
  std::vector<at::Tensor> losses;
  const std::vector<std::string> errors =
      run_as_processes(schedule, stages, inputs, losses, /*failing_stage=*/1, /*debug_record=*/true);
  // Device 1 failed in its forward of micro-batch 1, right after its third exchange, which sent
  // micro-batch 0's gradient back (the plan is fixed, so this is too): device 0 learns where it stood.
  EXPECT_NE(errors[0].find("pipeline rank 1 last posted exchange #2 [send grad 0 s1->s0 to 0]"), std::string::npos)
      << errors[0];
}

TEST(ProcessTransport, RefusesATensorOfAnotherShapeNamingTheMessage) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  data_parallel::DistOptions options;
  auto group = data_parallel::create_backend(data_parallel::Backend::kGloo, store, 0, 1, options);
  ProcessTransport transport(group, Device::cpu(0), [](const P2PMessage&) { return std::vector<int64_t>{2, 3}; });
  const P2POp send{P2POp::Kind::kSend, 0, {P2PMessage::Kind::kActivation, 2, 0}};
  try {
    transport.exchange(0, {send}, [](const P2PMessage&) { return torch::zeros({2, 4}); });
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("send act 2 s0->s1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[2, 3]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(p2p_tag({P2PMessage::Kind::kActivation, 3, 1}), (2 << 20) | 3);
  EXPECT_NE(p2p_tag({P2PMessage::Kind::kGradient, 3, 1}), p2p_tag({P2PMessage::Kind::kActivation, 3, 1}));
}

}  // namespace
}  // namespace harness::pipeline
