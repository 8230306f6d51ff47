// The launcher: environment parsing, line labelling, and real worker processes (this binary run
// again as workers, see worker_test.cpp) that succeed, fail, get killed, or are interrupted.
#include "harness/data_parallel/launcher.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "test_support.h"

namespace harness::data_parallel {
namespace {

using testing::launch_scenario;
using testing::process_gone;
using Env = std::map<std::string, std::string>;

TEST(WorkerEnv, ReadsTorchrunVariables) {
  const auto w = worker_env_from({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                  {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->rank, 3);
  EXPECT_EQ(w->world_size, 4);
  EXPECT_EQ(w->local_rank, 1);
  EXPECT_EQ(w->master_addr, "node7");
  EXPECT_EQ(w->master_port, 29500);
  const auto defaults = worker_env_from({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  ASSERT_TRUE(defaults.has_value());
  EXPECT_EQ(defaults->local_rank, 1);
  EXPECT_EQ(defaults->master_addr, "localhost");
  EXPECT_EQ(defaults->master_port, 11868);
  EXPECT_FALSE(worker_env_from({}).has_value());
}

TEST(WorkerEnv, ReadsTorchElasticsAgentStoreAndRestartCount) {
  const auto w = worker_env_from({{"RANK", "1"}, {"WORLD_SIZE", "2"},
                                  {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                  {"TORCHELASTIC_RESTART_COUNT", "3"}});
  ASSERT_TRUE(w.has_value());
  EXPECT_TRUE(w->use_agent_store);
  EXPECT_EQ(w->restart_count, 3);
  const auto plain = worker_env_from({{"RANK", "1"}, {"WORLD_SIZE", "2"},
                                      {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_FALSE(plain->use_agent_store);
  EXPECT_EQ(plain->restart_count, 0);
  EXPECT_THROW(worker_env_from({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RESTART_COUNT", "x"}}),
               std::invalid_argument);
}

TEST(Launcher, RestartsResumeAutomatically) {
  EXPECT_EQ(with_resume_auto({"prog", "--resume", "none", "--seed", "3", "--resume=/x"}),
            (std::vector<std::string>{"prog", "--seed", "3", "--resume", "auto"}));
  EXPECT_EQ(with_resume_auto({"prog"}), (std::vector<std::string>{"prog", "--resume", "auto"}));
  EXPECT_THROW(launch_with_restarts({"prog"}, 1, "localhost", 1, -1), std::invalid_argument);
}

TEST(WorkerEnv, ReadsSlurmVariables) {
  const auto w = worker_env_from({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"},
                                  {"SLURM_LOCALID", "1"}, {"MASTER_ADDR", "gpu01"}});
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->rank, 5);
  EXPECT_EQ(w->world_size, 8);
  EXPECT_EQ(w->local_rank, 1);
  EXPECT_EQ(w->master_addr, "gpu01");
  EXPECT_EQ(w->master_port, 11868);
  // One task without a master address: a plain run inside an allocation, not a worker.
  EXPECT_FALSE(worker_env_from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}).has_value());
  // Torchrun's variables win over Slurm's.
  EXPECT_EQ(worker_env_from({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"SLURM_PROCID", "5"},
                             {"SLURM_NTASKS", "8"}})->world_size, 1);
}

void expect_error(const Env& env, const std::string& needle) {
  try {
    worker_env_from(env);
    ADD_FAILURE() << "accepted, expected an error containing: " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(WorkerEnv, MalformedValuesNameTheVariable) {
  expect_error({{"RANK", "one"}, {"WORLD_SIZE", "2"}}, "RANK='one'");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2x"}}, "WORLD_SIZE='2x'");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE='0'");
  expect_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2 is not below WORLD_SIZE=2");
  expect_error({{"RANK", "0"}}, "WORLD_SIZE is not");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT='70000'");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-1"}}, "LOCAL_RANK='-1'");
  expect_error({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}}, "MASTER_ADDR is not set");
  expect_error({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "4"}}, "SLURM_PROCID='x'");
}

TEST(Launcher, LabelsOnlyLinesThatDoNotNameTheirRank) {
  const std::string epoch = "Epoch 3 on Rank 1: Training Time = 2.5, Tokens_per_sec = 100";
  EXPECT_EQ(label_worker_line(1, epoch), epoch);
  EXPECT_EQ(label_worker_line(0, "Rank 0 training time: avg:1, std:0"),
            "Rank 0 training time: avg:1, std:0");
  EXPECT_EQ(label_worker_line(1, "[rank 1] already labelled"), "[rank 1] already labelled");
  EXPECT_EQ(label_worker_line(1, "loading the model"), "[rank 1] loading the model");
  EXPECT_EQ(label_worker_line(0, "Ranking 3 things"), "[rank 0] Ranking 3 things");
  EXPECT_EQ(label_worker_line(0, "prank 3"), "[rank 0] prank 3");
}

TEST(Launcher, ForwardsOutputAndSetsTheEnvironment) {
  const auto run = launch_scenario("echo", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
  const std::string all = run.joined();
  for (int r = 0; r < 2; ++r) {
    const std::string rs = std::to_string(r);
    EXPECT_NE(all.find("out: [rank " + rs + "] plain line from a worker\n"), std::string::npos) << all;
    EXPECT_NE(all.find("out: Epoch 0 on Rank " + rs + ": Training Time = 1.5"), std::string::npos);
    EXPECT_NE(all.find("out: [rank " + rs + "] env RANK=" + rs + " WORLD_SIZE=2 LOCAL_RANK=" + rs +
                       " MASTER_ADDR=localhost MASTER_PORT="),
              std::string::npos)
        << all;
    EXPECT_NE(all.find("out: [rank " + rs + "] partial line without newline\n"), std::string::npos);
    EXPECT_NE(all.find("err: [rank " + rs + "] a warning on stderr\n"), std::string::npos);
  }
}

TEST(Launcher, AFailingWorkerStopsTheOthersQuickly) {
  const auto start = std::chrono::steady_clock::now();
  const auto run = launch_scenario("fail", 3);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(run.result.exit_code, 3);
  EXPECT_EQ(run.result.failure, "rank 1 exited with status 3") << run.joined();
  EXPECT_LT(seconds, 20.0);
  ASSERT_EQ(run.result.pids.size(), 3u);
  for (pid_t pid : run.result.pids) EXPECT_TRUE(process_gone(pid)) << "pid " << pid << " survived";
  // The others were stopped by SIGTERM, not left to finish their 60 s.
  EXPECT_TRUE(WIFSIGNALED(run.result.wait_status[0]));
  EXPECT_TRUE(WIFSIGNALED(run.result.wait_status[2]));
}

TEST(Launcher, a5_SigkillOfOneWorkerEndsTheLaunchWithinThirtySeconds) {
  const auto start = std::chrono::steady_clock::now();
  const auto run = launch_scenario("sigkill", 2);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(run.result.exit_code, 0);
  EXPECT_EQ(run.result.failure, "rank 1 was killed by signal 9 (SIGKILL)") << run.joined();
  EXPECT_LT(seconds, 30.0);
  for (pid_t pid : run.result.pids) EXPECT_TRUE(process_gone(pid)) << "pid " << pid << " survived";
  // The workers' TMPDIR was the launch's own folder, gone with what the killed worker left there.
  const std::string all = run.joined();
  const std::string said = "scratch folder ";
  const size_t at = all.find(said);
  ASSERT_NE(at, std::string::npos) << all;
  const std::string folder = all.substr(at + said.size(), all.find('\n', at) - at - said.size());
  EXPECT_EQ(folder.rfind((std::filesystem::temp_directory_path() / "harness-launch-").string(), 0), 0u) << folder;
  EXPECT_NE(::access(folder.c_str(), F_OK), 0) << folder << " is still there";
}

TEST(Launcher, AWorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  const std::string ready = "/tmp/harness_stubborn_ready_" + std::to_string(::getpid());
  std::remove(ready.c_str());
  const auto start = std::chrono::steady_clock::now();
  const auto run = launch_scenario("stubborn", 2, {{"HARNESS_TEST_READY_FILE", ready}}, std::chrono::milliseconds(1000));
  std::remove(ready.c_str());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(run.result.exit_code, 2);
  EXPECT_EQ(run.result.failure, "rank 1 exited with status 2");
  ASSERT_TRUE(WIFSIGNALED(run.result.wait_status[0])) << run.joined();
  EXPECT_EQ(WTERMSIG(run.result.wait_status[0]), SIGKILL);
  EXPECT_LT(seconds, 20.0);
  for (pid_t pid : run.result.pids) EXPECT_TRUE(process_gone(pid));
}

// Launches the "sleep" scenario on another thread, waits until every rank said it is ready (a
// handshake, not a delay), sends `sig` to this process, and returns the launch.
testing::CapturedLaunch interrupt_sleeping_workers(int sig) {
  std::mutex mutex;
  std::condition_variable changed;
  int ready = 0;
  testing::CapturedLaunch run;
  std::thread launcher([&] {
    run = launch_scenario("sleep", 2, {}, std::chrono::seconds(5), [&](LaunchOptions& options) {
      options.sink = [&](int, bool, const std::string& line) {
        if (line.find("ready on rank") == std::string::npos) return;
        std::lock_guard<std::mutex> lock(mutex);
        ++ready;
        changed.notify_all();
      };
    });
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait_for(lock, std::chrono::seconds(60), [&] { return ready == 2; });
  }
  ::kill(::getpid(), sig);  // the launcher's handler is installed for the whole launch
  launcher.join();
  return run;
}

TEST(Launcher, SigintToTheLauncherStopsEveryWorker) {
  const auto start = std::chrono::steady_clock::now();
  const auto run = interrupt_sleeping_workers(SIGINT);
  EXPECT_EQ(run.result.exit_code, 128 + SIGINT);
  EXPECT_TRUE(run.result.interrupted);
  EXPECT_NE(run.result.failure.find("SIGINT"), std::string::npos) << run.result.failure;
  for (pid_t pid : run.result.pids) EXPECT_TRUE(process_gone(pid));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

TEST(Launcher, SigtermToTheLauncherStopsEveryWorkerWithinTenSeconds) {
  const auto run = interrupt_sleeping_workers(SIGTERM);
  EXPECT_EQ(run.result.exit_code, 128 + SIGTERM) << "the shell's convention for a signal";
  EXPECT_NE(run.result.failure.find("SIGTERM"), std::string::npos) << run.result.failure;
  for (pid_t pid : run.result.pids) EXPECT_TRUE(process_gone(pid));
  // The workers exit on SIGTERM at once; the 5 s grace would bound a stubborn one.
  ASSERT_EQ(run.result.wait_status.size(), 2u);
  for (int status : run.result.wait_status) EXPECT_TRUE(WIFSIGNALED(status));
}

int open_descriptors() {
  int count = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir) != nullptr) ++count;
    ::closedir(dir);
  }
  return count;
}

bool no_children_left() {
  errno = 0;
  return ::waitpid(-1, nullptr, WNOHANG) == -1 && errno == ECHILD;
}

// A launch that throws: the message, and nothing left behind (no worker, zombie or descriptor).
void expect_clean_failure(const std::function<void(LaunchOptions&)>& customize, const std::string& scenario,
                          const std::string& needle) {
  ASSERT_TRUE(no_children_left()) << "an earlier test left a child";
  const int before = open_descriptors();
  try {
    launch_scenario(scenario, 3, {}, std::chrono::seconds(5), customize);
    ADD_FAILURE() << "the launch did not fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_TRUE(no_children_left()) << "a worker was left running or unreaped";
  EXPECT_EQ(open_descriptors(), before) << "descriptors leaked";
}

TEST(Launcher, AFailedPipeKillsAndReapsTheStartedWorkersAndLeaksNothing) {
  expect_clean_failure([](LaunchOptions& o) {
    o.fail_system_call = [](const char* call, int rank) { return std::string(call) == "pipe2" && rank == 2 ? EMFILE : 0; };
  }, "sleep", "pipe for rank 2 failed: Too many open files");
}

TEST(Launcher, AFailedForkKillsAndReapsTheStartedWorkersAndLeaksNothing) {
  expect_clean_failure([](LaunchOptions& o) {
    o.fail_system_call = [](const char* call, int rank) { return std::string(call) == "fork" && rank == 1 ? EAGAIN : 0; };
  }, "sleep", "fork of rank 1 failed");
}

TEST(Launcher, AnExceptionWhileForwardingOutputStopsEveryWorker) {
  expect_clean_failure([](LaunchOptions& o) {
    o.sink = [](int, bool, const std::string& line) {
      if (line.find("ready on rank") != std::string::npos) throw std::runtime_error("the terminal went away");
    };
  }, "sleep", "the terminal went away");
}

TEST(Launcher, ARankThatLeftEarlyIsNamedWhenAnotherFails) {
  const auto run = launch_scenario("leave_early", 2, {{"HARNESS_TEST_FAIL_AFTER_MS", "1500"}});
  EXPECT_EQ(run.result.exit_code, 1);
  EXPECT_NE(run.result.failure.find("rank 1 exited with status 1 (rank 0 exited with status 0"), std::string::npos)
      << run.result.failure;
  EXPECT_NE(run.result.failure.find("while the others kept running"), std::string::npos) << run.result.failure;
}

TEST(Launcher, ARankThatLeftEarlyEndsTheRunWhenTheOthersNeverFinish) {
  const auto start = std::chrono::steady_clock::now();
  const auto run = launch_scenario("leave_early", 2, {}, std::chrono::seconds(5), [](LaunchOptions& o) {
    o.unresponsive_worker_timeout = std::chrono::milliseconds(1500);
  });
  EXPECT_EQ(run.result.exit_code, 1);
  EXPECT_EQ(run.result.failure.rfind("rank 0 exited with status 0", 0), 0u) << run.result.failure;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20.0);
  for (pid_t pid : run.result.pids) EXPECT_TRUE(process_gone(pid));
}

// Served by the launcher, the rendezvous store outlives rank 0 (the workers are told to connect
// to it); served by rank 0, as without serve_store, it leaves with rank 0.
TEST(Launcher, TheStoreItServesOutlivesRankZero) {
  const auto served = launch_scenario("store_outlives_rank0", 2, {}, std::chrono::seconds(5),
                                      [](LaunchOptions& o) { o.serve_store = true; });
  EXPECT_EQ(served.result.exit_code, 0) << served.result.failure << "\n" << served.joined();
  EXPECT_NE(served.joined().find("scenario store_outlives_rank0 passed on rank 1"), std::string::npos)
      << served.joined();
  const auto rank_zeros = launch_scenario("store_outlives_rank0", 2);
  EXPECT_NE(rank_zeros.result.exit_code, 0) << rank_zeros.joined();
}

TEST(Launcher, ServingTheStoreOnAPortInUseNamesTheFlag) {
  const int port = test_workers::free_port();
  auto holder = c10::make_intrusive<c10d::TCPStore>("localhost", [&] {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = true;
    o.waitWorkers = false;
    return o;
  }());
  LaunchOptions options;
  options.serve_store = true;
  try {
    run_workers({"/bin/true"}, 1, "localhost", port, options);
    FAIL() << "a second store on one port must be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--master_port " + std::to_string(port)), std::string::npos) << e.what();
  }
}

// A scenario over 3 workers, the launcher serving the store (and elastic where asked).
testing::CapturedLaunch served_launch(const std::string& scenario, bool elastic) {
  return launch_scenario(scenario, 3, {}, std::chrono::seconds(5), [elastic](LaunchOptions& o) {
    o.serve_store = true;
    o.elastic = elastic;
  });
}

// --elastic: a lost worker is recorded in the store the launcher serves, the others go on, agree
// on the next generation and all-reduce over it; the launch succeeds.
TEST(Launcher, ElasticSurvivorsOfAKilledWorkerAgreeAndConnectAgain) {
  const auto run = served_launch("elastic_kill", true);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
  EXPECT_EQ(run.result.lost, std::vector<int>{1});
  EXPECT_NE(run.result.failure.find("rank 1 was killed by signal 9 (SIGKILL)"), std::string::npos) << run.result.failure;
}

// A worker stopped past the collective timeout is left out of the next generation; continued, it
// is refused as a process of a dead generation, and exits (lost, the launch still a success).
TEST(Launcher, ElasticStoppedWorkerIsLeftOutThenRefusedWhenItComesBack) {
  const auto run = served_launch("elastic_stop", true);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
  EXPECT_EQ(run.result.lost, std::vector<int>{1});
  EXPECT_NE(run.joined().find("rank 1 refused: elastic: process 1 belongs to generation 0, and generation 1 went on "
                              "without it (members {0,2})"),
            std::string::npos)
      << run.joined();
}

// With replacements, a lost worker's place is taken by a new process: the lost one's RANK and
// LOCAL_RANK, a launch id of its own past the world, its lines labelled with that id; started once
// the survivors went on without the lost one.
TEST(Launcher, ElasticReplacesALostWorkerWithANewProcess) {
  const auto run = launch_scenario("elastic_replace", 2, {}, std::chrono::seconds(5), [](LaunchOptions& o) {
    o.serve_store = true;
    o.elastic = true;
    o.max_replacements = 1;
  });
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
  EXPECT_EQ(run.result.lost, std::vector<int>{1});
  EXPECT_EQ(run.result.replacements, (std::vector<LaunchResult::Replacement>{{2, 1}}));
  EXPECT_EQ(run.result.pids.size(), 3u);
  const std::string all = run.joined();
  EXPECT_NE(all.find("out: [rank 2] replacement 2 started"), std::string::npos) << all;
  EXPECT_NE(all.find("out: rank 0 met replacement 2 for rank 1 on local rank 1"), std::string::npos) << all;
  // It starts once the survivors went on without rank 1 (recovered_key), not at the loss.
  EXPECT_NE(all.find("out: no replacement before rank 0 went on"), std::string::npos) << all;
}

TEST(Launcher, WithoutElasticALostWorkerStillEndsTheRun) {
  const auto run = served_launch("elastic_kill", false);
  EXPECT_NE(run.result.exit_code, 0) << run.joined();
  EXPECT_TRUE(run.result.lost.empty());
}

TEST(Launcher, RejectsBadArguments) {
  EXPECT_THROW(run_workers({"x"}, 0, "localhost", 1234), std::invalid_argument);
  EXPECT_THROW(run_workers({}, 2, "localhost", 1234), std::invalid_argument);
}

}  // namespace
}  // namespace harness::data_parallel
