// Process-group set-up and gradient averaging: errors in-process, then real Gloo all-reduces
// between two worker processes (this binary run again, see worker_test.cpp).
#include "harness/data_parallel/process_group.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <thread>
#include <torch/torch.h>

#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include "harness/data_parallel/grad_sync.h"
#include "test_support.h"

namespace harness::data_parallel {
namespace {

using testing::free_port;
using testing::launch_scenario;

std::string error_of(const DistOptions& options) {
  try {
    init_process_group(options);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ProcessGroup, ResolvesTheBackendByDevice) {
  EXPECT_EQ(resolve_backend(Backend::kAuto, Device::cpu()), Backend::kGloo);
  EXPECT_EQ(resolve_backend(Backend::kGloo, Device::cpu(1)), Backend::kGloo);
  EXPECT_EQ(resolve_backend(Backend::kAuto, Device::cuda(0)), Backend::kNccl);
  EXPECT_THROW(parse_backend("mpi"), std::invalid_argument);
  for (const Backend backend : {Backend::kAuto, Backend::kGloo, Backend::kNccl}) {
    EXPECT_EQ(parse_backend(to_string(backend)), backend);
  }
  try {
    resolve_backend(Backend::kNccl, Device::cpu());
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--backend gloo"), std::string::npos) << e.what();
  }
}

TEST(ProcessGroup, NcclWithoutAGpuSaysWhichFlagsToUse) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  DistOptions o;
  o.device = Device::cuda(0);
  o.master_port = free_port();
  const std::string error = error_of(o);
  EXPECT_NE(error.find("use --backend gloo --device cpu"), std::string::npos) << error;
}

TEST(ProcessGroup, RejectsBadOptions) {
  DistOptions o;
  o.rank = 2;
  o.world_size = 2;
  EXPECT_NE(error_of(o).find("rank 2 is outside"), std::string::npos);
  o.rank = 0;
  o.master_port = 70000;
  EXPECT_NE(error_of(o).find("--master_port 70000"), std::string::npos);
}

TEST(ProcessGroup, PortInUseOnRankZeroNamesTheFlag) {
  // Hold a listening socket on the port, as another job would.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  DistOptions o;
  o.world_size = 2;
  o.master_port = port;
  o.timeout = std::chrono::seconds(5);
  const std::string error = error_of(o);
  ::close(fd);
  EXPECT_NE(error.find("MASTER_PORT " + std::to_string(port) +
                       " on localhost is in use: pick another with --master_port"),
            std::string::npos)
      << error;
}

TEST(ProcessGroup, RendezvousTimeoutSaysWhoWaitedForWhom) {
  DistOptions o;
  o.rank = 1;
  o.world_size = 2;
  o.master_port = free_port();  // nobody serves it
  o.timeout = std::chrono::milliseconds(1500);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of(o);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  EXPECT_NE(error.find("rank 1 waited 1.5s for rank 0 at localhost:" +
                       std::to_string(o.master_port)),
            std::string::npos)
      << error;
}

TEST(ProcessGroup, RankZeroTimeoutSaysItWaitedForTheOthers) {
  DistOptions o;
  o.world_size = 3;
  o.master_port = free_port();  // rank 0 serves it, nobody joins
  o.timeout = std::chrono::milliseconds(1500);
  const std::string error = error_of(o);
  EXPECT_NE(error.find("rank 0 waited 1.5s at localhost:" + std::to_string(o.master_port) +
                       " for the other 2 rank(s)"),
            std::string::npos)
      << error;
}

// Rank 1 of three joins, rank 2 never does: rank 0's error names rank 2, not only a count.
TEST(ProcessGroup, RankZeroTimeoutNamesTheMissingRanks) {
  DistOptions o;
  o.world_size = 3;
  o.master_port = free_port();
  o.timeout = std::chrono::milliseconds(3000);
  std::thread rank1([port = o.master_port] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    c10d::TCPStoreOptions client;
    client.port = static_cast<uint16_t>(port);
    client.isServer = false;
    client.timeout = std::chrono::seconds(5);
    try {
      c10d::TCPStore store("localhost", client);
      store.set("harness/joined/1", std::vector<uint8_t>{1});
    } catch (...) {
    }
  });
  const std::string error = error_of(o);
  rank1.join();
  EXPECT_NE(error.find("for the other 2 rank(s)"), std::string::npos) << error;
  EXPECT_NE(error.find("missing: rank 2 of --world_size 3"), std::string::npos) << error;
}

// An IPv4 address of this machine's own, on an interface that is up and not loopback ("" if none).
std::string own_non_loopback_address() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return "";
  std::string found;
  for (const ifaddrs* i = all; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    found = text;
  }
  ::freeifaddrs(all);
  return found;
}

// Gloo's interface: GLOO_SOCKET_IFNAME first, loopback on one machine, else the address that
// routes to MASTER_ADDR (never the hostname's loopback address).
TEST(ProcessGroup, GlooBindsToTheAddressThatRoutesToTheMaster) {
  const GlooInterface named = choose_gloo_interface("10.1.2.3", 29500, "eth7");
  EXPECT_EQ(named.kind, GlooInterface::Kind::kInterfaceName);
  EXPECT_EQ(named.value, "eth7");
  EXPECT_EQ(named.reason, "GLOO_SOCKET_IFNAME");
  for (const char* loopback : {"localhost", "127.0.0.1"}) {
    const GlooInterface one_machine = choose_gloo_interface(loopback, 29500, "");
    EXPECT_EQ(one_machine.kind, GlooInterface::Kind::kAddress);
    EXPECT_EQ(one_machine.value, "127.0.0.1");
  }
  EXPECT_EQ(local_address_toward("127.0.0.1", 29500), "127.0.0.1");
  try {
    local_address_toward("no-such-host.invalid", 29500);
    ADD_FAILURE() << "an unresolvable MASTER_ADDR was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR no-such-host.invalid does not resolve"),
              std::string::npos) << e.what();
  }
  const std::string own = own_non_loopback_address();
  if (own.empty()) GTEST_SKIP() << "this machine has no non-loopback IPv4 address that is up";
  const GlooInterface routed = choose_gloo_interface(own, 29500, nullptr);
  EXPECT_EQ(routed.kind, GlooInterface::Kind::kAddress);
  EXPECT_EQ(routed.value, own);  // toward its own address a host uses that address, not 127.x
  EXPECT_NE(routed.reason.find("routes to MASTER_ADDR " + own), std::string::npos) << routed.reason;
}

TEST(ProcessGroup, SingleRankGlooGroupWorksInProcess) {
  DistOptions o;
  o.master_port = free_port();
  o.timeout = std::chrono::seconds(30);
  DistContext ctx = init_process_group(o);
  EXPECT_EQ(ctx.backend, Backend::kGloo);
  EXPECT_EQ(ctx.world_size, 1);
  at::Tensor t = torch::arange(5, torch::kFloat32);
  all_reduce_sum(ctx, t);
  EXPECT_TRUE(torch::equal(t, torch::arange(5, torch::kFloat32)));

  // With one rank, averaging leaves the gradients as they are; parameters without one stay so.
  torch::manual_seed(0);
  torch::nn::Linear used(3, 2), unused(3, 2);
  used->forward(torch::ones({4, 3})).sum().backward();
  const at::Tensor before = used->weight.grad().clone();
  average_gradients(*used, ctx);
  EXPECT_TRUE(torch::equal(used->weight.grad(), before));
  NaiveAllReduce sync(ctx);
  sync.attach(*unused);
  sync.finalize();
  EXPECT_FALSE(unused->weight.grad().defined());
  EXPECT_THROW(parse_gradient_sync("fancy"), std::invalid_argument);
  for (const GradientSyncKind kind : {GradientSyncKind::kNaive, GradientSyncKind::kBucketed}) {
    EXPECT_EQ(parse_gradient_sync(to_string(kind)), kind);
  }
}

// Gloo writes to its peers with writev: where a peer's socket is gone, the write must fail (EPIPE,
// and the collective raises) instead of SIGPIPE ending this process. A write to a socket whose
// other end is closed, after a Gloo group was made, returns the error and the test goes on.
TEST(ProcessGroup, AfterAGlooGroupAWriteToAGonePeerFailsInsteadOfEndingTheProcess) {
  DistOptions o;
  o.master_port = free_port();
  o.timeout = std::chrono::seconds(30);
  const DistContext ctx = init_process_group(o);
  ASSERT_EQ(ctx.backend, Backend::kGloo);
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::close(fds[1]);
  const char byte = 0;
  errno = 0;
  EXPECT_EQ(::write(fds[0], &byte, 1), -1);
  EXPECT_EQ(errno, EPIPE);
  ::close(fds[0]);
}

TEST(ProcessGroup, TwoProcessGlooAllReduce) {
  const auto run = launch_scenario("allreduce", 2);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
}

TEST(GradSync, NaiveAllReduceAveragesAcrossTwoProcessesBitIdentically) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("dp_naive_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto run = launch_scenario("naive", 2, {{"HARNESS_TEST_GRAD_DIR", dir.string()}});
  EXPECT_EQ(run.result.exit_code, 0) << run.result.failure << "\n" << run.joined();
  // Both ranks' averaged gradients, written as .pth, are bit-identical (the --pytest check).
  const std::string command = std::string(HARNESS_SOURCE_DIR) + "/.venv/bin/python " +
                              HARNESS_SOURCE_DIR + "/scripts/check_gradients.py " + dir.string();
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  testing::remove_tree(dir.string());
}

}  // namespace
}  // namespace harness::data_parallel
