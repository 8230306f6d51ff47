// The schedule executor on toy stages: every schedule and checkpointing mode gives plain
// autograd's gradients, the workers run each device's actions in the schedule's order, a failure
// stops every worker and names the action, recomputation replays the random stream, and the
// held forwards per device match the schedule's bound.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <set>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/model/dropout.h"
#include "harness/pipeline/executor.h"
#include "harness/pipeline/gpipe_plan.h"
#include "harness/pipeline/training_schedule.h"

namespace harness::pipeline {
namespace {

// S stages, each y = tanh(x W_s) with a random keep-mask drawn from the thread's dropout stream
// when `noisy`; the last stage's output is the micro-batch's share of sum(y^2) / rows.
struct ToyModel {
  std::vector<at::Tensor> weights;  // [stage] 8 x 8 leaves
  bool noisy = false;

  explicit ToyModel(int stages, bool noisy_ = false) : noisy(noisy_) {
    torch::manual_seed(11);
    for (int s = 0; s < stages; ++s) weights.push_back(torch::randn({8, 8}).mul_(0.5).requires_grad_(true));
  }
  at::Tensor stage(int s, const at::Tensor& x) const {
    at::Tensor y = torch::tanh(torch::matmul(x, weights[s]));
    if (noisy) {
      std::optional<at::Generator> stream = model::current_dropout_generator();
      if (!stream) throw std::logic_error("no dropout stream installed");
      y = y * at::empty_like(y).bernoulli_(0.7, *stream);
    }
    return y;
  }
  std::vector<at::Tensor> grads() const {
    std::vector<at::Tensor> out;
    for (const auto& w : weights) out.push_back(w.grad().clone());
    return out;
  }
  void zero_grad() {
    for (auto& w : weights) w.mutable_grad() = at::Tensor();
  }
};

StageForward toy_forward(const ToyModel& model, const std::vector<at::Tensor>& chunks, int64_t rows) {
  const int S = static_cast<int>(model.weights.size());
  return [&model, &chunks, rows, S](int i, int s, const at::Tensor& input) {
    at::Tensor y = model.stage(s, s == 0 ? chunks[i] : input);
    return s == S - 1 ? y.pow(2).sum() / rows : y;
  };
}

std::vector<at::Tensor> reference_grads(ToyModel& model, const at::Tensor& x) {
  model.zero_grad();
  at::Tensor h = x;
  for (size_t s = 0; s < model.weights.size(); ++s) h = model.stage(static_cast<int>(s), h);
  (h.pow(2).sum() / x.size(0)).backward();
  return model.grads();
}

std::vector<Device> lanes(int n) {
  std::vector<Device> out;
  for (int d = 0; d < n; ++d) out.push_back(Device::cpu(d));
  return out;
}

struct Case {
  TrainingSchedule schedule;
  ActivationCheckpointing checkpointing;
};

TEST(ScheduleExecutor, EveryScheduleAndCheckpointingGivesPlainAutogradsGradients) {
  const at::Tensor x = torch::randn({12, 8});
  std::vector<Case> cases;
  for (auto mode : {ActivationCheckpointing::kNever, ActivationCheckpointing::kExceptLast,
                    ActivationCheckpointing::kAlways}) {
    cases.push_back({gpipe_schedule(4, 2), mode});
    cases.push_back({one_f_one_b_schedule(4, 2), mode});
    cases.push_back({one_f_one_b_schedule(3, 3), mode});
    cases.push_back({interleaved_schedule(4, 2, 2), mode});
    cases.push_back({gpipe_schedule(3, 2, 2), mode});
  }
  for (const Case& c : cases) {
    const std::string what = c.schedule.name + " D=" + std::to_string(c.schedule.devices) + " V=" +
                             std::to_string(c.schedule.virtual_stages) + " M=" +
                             std::to_string(c.schedule.micro_batches) + " " + to_string(c.checkpointing);
    ToyModel model(c.schedule.stages());
    const std::vector<at::Tensor> expected = reference_grads(model, x);
    model.zero_grad();
    ExecutorOptions options;
    options.threads_per_device = 1;
    options.checkpointing = c.checkpointing;
    ScheduleExecutor executor(lanes(c.schedule.devices), options);
    const std::vector<at::Tensor> chunks = x.tensor_split(c.schedule.micro_batches, 0);
    StepResult result = executor.run(c.schedule, toy_forward(model, chunks, x.size(0)), 7);
    ASSERT_EQ(result.losses.size(), static_cast<size_t>(c.schedule.micro_batches)) << what;
    const std::vector<at::Tensor> actual = model.grads();
    for (size_t s = 0; s < expected.size(); ++s) {
      EXPECT_TRUE(torch::allclose(actual[s], expected[s], 1e-5, 1e-7)) << what << ": stage " << s;
    }
  }
}

TEST(ScheduleExecutor, EachDeviceRunsItsActionsInTheSchedulesOrder) {
  Tracer tracer;
  ExecutorOptions options;
  options.threads_per_device = 1;
  options.tracer = &tracer;
  const TrainingSchedule schedule = interleaved_schedule(4, 2, 2);
  ToyModel model(schedule.stages());
  const at::Tensor x = torch::randn({8, 8});
  const std::vector<at::Tensor> chunks = x.tensor_split(4, 0);
  ScheduleExecutor executor(lanes(2), options);
  executor.run(schedule, toy_forward(model, chunks, 8), 1);

  std::map<std::string, std::vector<Tracer::Slice>> by_track;
  for (const auto& slice : tracer.slices()) by_track[slice.track].push_back(slice);
  ASSERT_EQ(by_track.size(), 2u);
  for (int d = 0; d < 2; ++d) {
    // A track's slices are recorded as its actions end, one after another: in execution order.
    const auto& slices = by_track["cpu:" + std::to_string(d)];
    ASSERT_EQ(slices.size(), schedule.per_device[d].size()) << "device " << d;
    for (size_t k = 0; k < slices.size(); ++k) {
      const Action& a = schedule.per_device[d][k];
      int64_t i = -1, s = -1;
      for (const auto& [key, value] : slices[k].args) {
        if (key == "micro_batch") i = std::get<int64_t>(value);
        if (key == "stage") s = std::get<int64_t>(value);
      }
      EXPECT_EQ(slices[k].name, a.kind == Action::Kind::kForward ? "forward" : "backward") << d << "/" << k;
      EXPECT_EQ(i, a.micro_batch) << "device " << d << ", action " << k;
      EXPECT_EQ(s, a.stage) << "device " << d << ", action " << k;
    }
  }
}

// Runs one step expected to fail, on another thread so that a hang fails the test instead of
// stalling it; returns the error's message ("" when the step hung, after a failed assertion).
std::string failure_of(ScheduleExecutor& executor, const TrainingSchedule& schedule, const StageForward& forward) {
  auto outcome = std::async(std::launch::async, [&] {
    try {
      executor.run(schedule, forward, 1);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  });
  if (outcome.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: a worker hangs after the failure\n");
    std::fflush(stderr);
    std::_Exit(1);  // the hung workers cannot be joined; end the test process
  }
  return outcome.get();
}

// A two-stage 1F1B step whose stage forwards the tests below break in one place.
class FailingStep : public ::testing::Test {
 protected:
  const TrainingSchedule schedule = one_f_one_b_schedule(4, 2);
  ToyModel model{2};
  const at::Tensor x = torch::randn({8, 8});
  const std::vector<at::Tensor> chunks = x.tensor_split(4, 0);
  ScheduleExecutor executor{lanes(2), {1}};
  const StageForward working = toy_forward(model, chunks, 8);
};

TEST_F(FailingStep, AFailingStageStopsEveryWorkerAndNamesTheAction) {
  const StageForward failing = [&](int i, int s, const at::Tensor& input) {
    if (i == 2 && s == 0) throw std::runtime_error("boom in the embedding");
    return working(i, s, input);
  };
  const std::string message = failure_of(executor, schedule, failing);
  EXPECT_NE(message.find("forward of micro-batch 2, stage 0"), std::string::npos) << message;
  EXPECT_NE(message.find("boom in the embedding"), std::string::npos) << message;
  EXPECT_NE(message.find("cpu:0"), std::string::npos) << message;
  EXPECT_EQ(message.find("stopped"), std::string::npos) << "the waiting device's stop is not the cause: " << message;
  // The same executor trains again afterwards.
  model.zero_grad();
  EXPECT_NO_THROW(executor.run(schedule, working, 1));
  EXPECT_TRUE(model.weights[0].grad().defined());
}

TEST(ScheduleExecutor, RecomputationReplaysTheStreamSoCheckpointingChangesNothing) {
  const TrainingSchedule schedule = one_f_one_b_schedule(4, 2);
  const at::Tensor x = torch::randn({8, 8});
  const std::vector<at::Tensor> chunks = x.tensor_split(4, 0);
  std::vector<std::vector<at::Tensor>> grads;
  for (auto mode : {ActivationCheckpointing::kNever, ActivationCheckpointing::kExceptLast,
                    ActivationCheckpointing::kAlways}) {
    ToyModel model(2, /*noisy=*/true);
    ExecutorOptions options;
    options.threads_per_device = 1;
    options.checkpointing = mode;
    ScheduleExecutor executor(lanes(2), options);
    executor.run(schedule, toy_forward(model, chunks, 8), 99);
    grads.push_back(model.grads());
  }
  for (size_t k = 1; k < grads.size(); ++k) {
    for (size_t s = 0; s < grads[0].size(); ++s) EXPECT_TRUE(torch::equal(grads[k][s], grads[0][s])) << k << "/" << s;
  }
  // Another step seed draws other masks.
  ToyModel model(2, /*noisy=*/true);
  ScheduleExecutor executor(lanes(2), {1});
  executor.run(schedule, toy_forward(model, chunks, 8), 100);
  EXPECT_FALSE(torch::equal(model.grads()[0], grads[0][0]));
}

TEST(ScheduleExecutor, HeldForwardsPerDeviceAreTheSchedulesBound) {
  const at::Tensor x = torch::randn({8, 8});
  const std::vector<at::Tensor> chunks = x.tensor_split(8, 0);
  ToyModel model(2);
  ScheduleExecutor executor(lanes(2), {1});
  EXPECT_EQ(executor.run(gpipe_schedule(8, 2), toy_forward(model, chunks, 8), 1).peak_in_flight,
            (std::vector<int>{8, 8}));
  EXPECT_EQ(executor.run(one_f_one_b_schedule(8, 2), toy_forward(model, chunks, 8), 1).peak_in_flight,
            (std::vector<int>{2, 1}));
}

TEST(ScheduleExecutor, TwoWorkersMayShareOneDevice) {
  const TrainingSchedule schedule = one_f_one_b_schedule(4, 2);
  ToyModel model(2);
  const at::Tensor x = torch::randn({8, 8});
  const std::vector<at::Tensor> expected = reference_grads(model, x);
  model.zero_grad();
  const std::vector<at::Tensor> chunks = x.tensor_split(4, 0);
  ScheduleExecutor executor({Device::cpu(0), Device::cpu(0)}, {1});
  executor.run(schedule, toy_forward(model, chunks, 8), 1);
  for (size_t s = 0; s < expected.size(); ++s) EXPECT_TRUE(torch::allclose(model.grads()[s], expected[s], 1e-5, 1e-7));
}

TEST(ScheduleExecutor, RejectsAScheduleForOtherDevicesAndBadModes) {
  ToyModel model(3);
  const at::Tensor x = torch::randn({4, 8});
  const std::vector<at::Tensor> chunks = x.tensor_split(2, 0);
  ScheduleExecutor executor(lanes(2), {1});
  EXPECT_THROW(executor.run(gpipe_schedule(2, 3), toy_forward(model, chunks, 4), 1), std::invalid_argument);
  EXPECT_THROW(ScheduleExecutor({}, {}), std::invalid_argument);
  try {
    parse_activation_checkpointing("sometimes");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--activation_checkpointing"), std::string::npos);
  }
  EXPECT_EQ(parse_activation_checkpointing("except_last"), ActivationCheckpointing::kExceptLast);
}

struct FailingBackward : torch::autograd::Function<FailingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("backward exploded");
  }
};

TEST_F(FailingStep, FailuresInABackwardAndNonStandardExceptionsStopEveryWorkerToo) {
  // Micro-batch 1's backward through the last stage fails.
  const StageForward bad_backward = [&](int i, int s, const at::Tensor& input) {
    at::Tensor out = working(i, s, input);
    return i == 1 && s == 1 ? FailingBackward::apply(out) : out;
  };
  const std::string message = failure_of(executor, schedule, bad_backward);
  EXPECT_NE(message.find("backward of micro-batch 1, stage 1"), std::string::npos) << message;
  EXPECT_NE(message.find("backward exploded"), std::string::npos) << message;
  const StageForward throws_int = [&](int i, int s, const at::Tensor& input) {
    if (i == 3 && s == 1) throw 42;
    return working(i, s, input);
  };
  EXPECT_NE(failure_of(executor, schedule, throws_int).find("non-standard exception"), std::string::npos);
}

TEST(ScheduleExecutor, CheckpointPlansAreLiteral) {
  using Plan = std::vector<std::vector<bool>>;
  // GPipe, except_last: torchgpipe's meaning, every micro-batch but the last.
  EXPECT_EQ(checkpoint_plan(gpipe_schedule(3, 2), ActivationCheckpointing::kExceptLast),
            (Plan{{true, true, false, false, false, false}, {true, true, false, false, false, false}}));
  // 1F1B: device 0 runs F0 F1 B0 F2 B1 F3 B2 B3, device 1 F0 B0 F1 B1 ...: no forward of the last
  // device is worth recomputing.
  EXPECT_EQ(checkpoint_plan(one_f_one_b_schedule(4, 2), ActivationCheckpointing::kExceptLast),
            (Plan{{true, true, false, true, false, true, false, false},
                  {false, false, false, false, false, false, false, false}}));
  EXPECT_EQ(checkpoint_plan(one_f_one_b_schedule(4, 2), ActivationCheckpointing::kAlways),
            (Plan{{true, true, false, true, false, true, false, false},
                  {true, false, true, false, true, false, true, false}}));
  EXPECT_EQ(checkpoint_plan(gpipe_schedule(2, 1), ActivationCheckpointing::kNever),
            (Plan{{false, false, false, false}}));
}

// A pipeline that is one part of a model: the ends are the caller's tensors, its outputs the
// plain chain's, and the forward half with the graph kept leaves the backward to autograd.
TEST(ScheduleExecutor, ThePipelinesEndsMayBeTheCallersWithTheGraphKeptWhole) {
  ToyModel model(3);
  const at::Tensor x = torch::randn({6, 8}).requires_grad_(true);
  at::Tensor expected = x;
  for (int s = 0; s < 3; ++s) expected = model.stage(s, expected);
  const at::Tensor target = torch::randn({6, 8});
  torch::mse_loss(expected, target).backward();
  const std::vector<at::Tensor> expected_grads = model.grads();
  const at::Tensor expected_x_grad = x.grad().clone();
  model.zero_grad();
  x.mutable_grad() = at::Tensor();

  ScheduleExecutor executor(lanes(3), {1});
  StageEnds ends(/*micro_batches=*/3, /*devices=*/3);
  ends.inputs = x.split(2, 0);
  ends.keep_graph = true;
  const StageForward forward = [&](int, int s, const at::Tensor& input) { return model.stage(s, input); };
  const StepResult result = executor.run_plan(gpipe_plan_halves(3, 3).forward, forward, 1, &ends);
  EXPECT_EQ(result.peak_in_flight, (std::vector<int>{0, 0, 0}));  // the graph is autograd's to hold
  const at::Tensor y = torch::cat(ends.outputs, 0);
  EXPECT_TRUE(torch::allclose(y, expected, 1e-6, 1e-6));
  ASSERT_TRUE(y.requires_grad());
  torch::mse_loss(y, target).backward();
  for (size_t s = 0; s < expected_grads.size(); ++s) {
    EXPECT_TRUE(torch::allclose(model.grads()[s], expected_grads[s], 1e-6, 1e-7)) << "stage " << s;
  }
  EXPECT_TRUE(torch::allclose(x.grad(), expected_x_grad, 1e-6, 1e-7));

  // A backward cannot run on a graph handed on whole.
  StageEnds whole(3, 3);
  whole.inputs = x.split(2, 0);
  whole.keep_graph = true;
  try {
    executor.run_plan(make_p2p_plan(gpipe_schedule(3, 3)), forward, 1, &whole);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    // Whichever device reaches its first backward (micro-batch 2's) first says so.
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("backward of micro-batch 2, stage ", 0), 0u) << message;
    EXPECT_NE(message.find(" failed: a backward action with the graph kept whole"), std::string::npos) << message;
  }
  EXPECT_THROW(executor.run_plan(gpipe_plan_halves(3, 2).forward, forward, 1, &ends), std::invalid_argument);
}

// The two halves run apart: the forwards now, the backwards later from the caller's output
// gradients, the held forwards kept in the ends in between; gradients are plain autograd's.
TEST(ScheduleExecutor, AStepRunsAsTwoHalvesFromTheCallersOutputGradients) {
  ToyModel model(2, /*noisy=*/true);
  const at::Tensor x = torch::randn({8, 8}).requires_grad_(true);
  const at::Tensor grad_y = torch::randn({8, 8});
  ExecutorOptions options;
  options.threads_per_device = 1;
  options.stage_word = "partition";
  Tracer tracer;
  options.tracer = &tracer;
  ScheduleExecutor executor(lanes(2), options);
  StageEnds ends(4, 2);
  ends.inputs = x.split(2, 0);
  const StageForward forward = [&](int, int s, const at::Tensor& input) { return model.stage(s, input); };
  const PlanHalves& halves = gpipe_plan_halves(4, 2);
  EXPECT_EQ(executor.run_plan(halves.forward, forward, 5, &ends).peak_in_flight, (std::vector<int>{4, 4}));
  for (const at::Tensor& out : ends.outputs) EXPECT_FALSE(out.requires_grad());
  const std::vector<at::Tensor> grad_chunks = grad_y.split(2, 0);
  for (int i = 0; i < 4; ++i) ends.grad_outputs[i] = grad_chunks[i];
  executor.run_plan(halves.backward, forward, 5, &ends);
  const std::vector<at::Tensor> grads = model.grads();
  const at::Tensor y = torch::cat(ends.outputs, 0);

  // The same masks again: the (step, micro-batch, stage) streams of step seed 5, one per task.
  model.zero_grad();
  std::vector<at::Tensor> outputs;
  for (int i = 0; i < 4; ++i) {
    at::Tensor h = x.split(2, 0)[i];
    for (int s = 0; s < 2; ++s) {
      model::DropoutGeneratorScope stream(model::make_generator(c10::kCPU, stage_stream_seed(5, i, s)));
      h = model.stage(s, h);
    }
    outputs.push_back(h);
  }
  const at::Tensor reference = torch::cat(outputs, 0);
  EXPECT_TRUE(torch::allclose(y, reference, 1e-6, 1e-6));
  const at::Tensor x_grad = torch::autograd::grad({reference}, {x}, {grad_y}, /*retain_graph=*/true)[0];
  reference.backward(grad_y);
  for (size_t s = 0; s < grads.size(); ++s) EXPECT_TRUE(torch::allclose(grads[s], model.grads()[s], 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(torch::cat(ends.grad_inputs, 0), x_grad, 1e-6, 1e-7));

  // Traced with the stage word given, every backward after every forward.
  int forwards = 0, backwards = 0;
  for (const auto& slice : tracer.slices()) {
    EXPECT_EQ(slice.args.at(1).first, "partition");
    (slice.name == "forward" ? forwards : backwards) += 1;
  }
  EXPECT_EQ(forwards, 8);
  EXPECT_EQ(backwards, 8);
}

TEST(ScheduleExecutor, StreamSeedsDifferAcrossStepsMicroBatchesAndStages) {
  std::set<uint64_t> seen;
  for (int64_t step = 0; step < 4; ++step) {
    const uint64_t step_seed = step_stream_seed(1234, step);
    for (int i = 0; i < 4; ++i) {
      for (int s = 0; s < 4; ++s) seen.insert(stage_stream_seed(step_seed, i, s));
    }
  }
  EXPECT_EQ(seen.size(), 64u);
  EXPECT_EQ(step_stream_seed(1234, 5), step_stream_seed(1234, 5));
  EXPECT_NE(step_stream_seed(1234, 5), step_stream_seed(1235, 5));
}

}  // namespace
}  // namespace harness::pipeline
