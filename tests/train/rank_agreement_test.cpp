// A rank that finds a peer gone names it: from the message the peer left in the store, or rank 0
// when the store (which rank 0 serves) is gone too; other errors pass unchanged. A rank whose
// collective failed (timed out, or a peer closed its connection) names the ranks that stopped with
// their reasons, the ranks that never answer through the store, or its own host as cut off when it
// cannot reach the store either.
#include "harness/train/rank_agreement.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <future>
#include <thread>

#include "harness/data_parallel/process_group.h"

namespace harness::train {
namespace {

const std::string kPeerGone = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:40404";

data_parallel::DistContext context(int rank, int world_size, c10::intrusive_ptr<c10d::Store> store) {
  data_parallel::DistContext ctx;
  ctx.rank = rank;
  ctx.world_size = world_size;
  ctx.store = std::move(store);
  return ctx;
}

TEST(ExplainStop, NamesThePeerThatLeftItsMessage) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  record_stop("--resume /x: no such checkpoint", context(2, 3, store));
  const std::string said = explain_stop(kPeerGone, context(0, 3, store));
  EXPECT_NE(said.find("rank 2 stopped, with: --resume /x: no such checkpoint"), std::string::npos) << said;
  EXPECT_NE(said.find("Connection closed by peer"), std::string::npos) << said;  // kept, as the detail
}

TEST(ExplainStop, OtherErrorsAndSingleRanksPassUnchanged) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  record_stop("gone", context(1, 2, store));
  EXPECT_EQ(explain_stop("--workdir /proc/self is not writable", context(0, 2, store)),
            "--workdir /proc/self is not writable");
  EXPECT_EQ(explain_stop(kPeerGone, context(0, 1, store)), kPeerGone);
}

TEST(ExplainStop, APeerGoneWithoutAMessageIsSaidSo) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string said = explain_stop(kPeerGone, context(0, 2, store));
  EXPECT_NE(said.find("another rank stopped without an error of its own"), std::string::npos) << said;
}

TEST(ExplainStop, AStoreGoneWithItsServerMeansRankZeroStopped) {
  c10d::TCPStoreOptions server_options;
  server_options.port = 0;
  server_options.isServer = true;
  server_options.numWorkers = 2;
  server_options.waitWorkers = false;
  server_options.timeout = std::chrono::seconds(5);
  auto server = std::make_unique<c10d::TCPStore>("127.0.0.1", server_options);
  c10d::TCPStoreOptions client_options;
  client_options.port = server->getPort();
  client_options.isServer = false;
  client_options.timeout = std::chrono::seconds(2);
  auto client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", client_options);
  client->set("harness/joined/1", std::vector<uint8_t>{1});
  server.reset();  // rank 0's process ended
  const std::string said = explain_stop(kPeerGone, context(1, 2, client));
  EXPECT_NE(said.find("rank 0 stopped"), std::string::npos) << said;
}

const std::string kTimedOut =
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv "
    "operation to complete";

// Ranks 0 and 1 time out together and answer; rank 2 (behind a cut link) never does.
TEST(ExplainFailedCollective, NamesTheRanksThatNeverAnswerWithTheirHosts) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  for (int r = 0; r < 3; ++r) {
    record_host("host" + std::to_string(r) + " 10.0.0." + std::to_string(r + 1), context(r, 3, store));
  }
  auto rank1 = std::async(std::launch::async, [&] {
    return explain_failed_collective(kTimedOut, context(1, 3, store), "host1 10.0.0.2", "10.0.0.1:5555",
                                     std::chrono::milliseconds(1000));
  });
  const CollectiveDiagnosis said = explain_failed_collective(kTimedOut, context(0, 3, store), "host0 10.0.0.1",
                                                             "10.0.0.1:5555", std::chrono::milliseconds(1000));
  EXPECT_TRUE(said.reached_store);
  EXPECT_NE(said.message.find("rank 2 (host2 10.0.0.3) did not answer through the rendezvous store at "
                              "10.0.0.1:5555 within 1 s"),
            std::string::npos) << said.message;
  EXPECT_NE(said.message.find("ranks 0, 1 (host0 10.0.0.1; host1 10.0.0.2) answered"), std::string::npos)
      << said.message;
  EXPECT_NE(said.message.find("Timed out waiting 10000ms"), std::string::npos) << said.message;  // the detail
  const std::string rank1_said = rank1.get().message;
  EXPECT_NE(rank1_said.find("rank 2 (host2 10.0.0.3) did not answer"), std::string::npos) << rank1_said;
}

TEST(ExplainFailedCollective, EveryRankAnsweringIsNoCutAndOtherErrorsPassUnchanged) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto rank1 = std::async(std::launch::async, [&] {
    return explain_failed_collective(kTimedOut, context(1, 2, store), "h1", "a:1",
                                     std::chrono::milliseconds(3000));
  });
  const auto started = std::chrono::steady_clock::now();
  const CollectiveDiagnosis said = explain_failed_collective(kTimedOut, context(0, 2, store), "h0", "a:1",
                                                             std::chrono::milliseconds(3000));
  // Both answered at once: neither waits out its window.
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(2500));
  EXPECT_NE(said.message.find("every rank still reaches the store"), std::string::npos) << said.message;
  rank1.get();
  const std::string other = "--workdir /proc/self is not writable";
  EXPECT_EQ(explain_failed_collective(other, context(0, 2, store), "h0", "a:1", std::chrono::seconds(1)).message,
            other);
  EXPECT_EQ(
      explain_failed_collective(kTimedOut, context(0, 1, store), "h0", "a:1", std::chrono::seconds(1)).message,
      kTimedOut);
}

// A peer that stopped with a reason of its own (a refusal, an error) is named with it, at once: it
// is not waited for as if it were out of reach.
TEST(ExplainFailedCollective, APeerThatStoppedWithAReasonIsNamedWithItWithoutWaiting) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  record_stop("--resume /x: no such checkpoint", context(1, 2, store));
  const auto started = std::chrono::steady_clock::now();
  const CollectiveDiagnosis said =
      explain_failed_collective(kPeerGone, context(0, 2, store), "h0", "a:1", std::chrono::seconds(5));
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(2));
  EXPECT_NE(said.message.find("rank 1 stopped, with: --resume /x: no such checkpoint"), std::string::npos)
      << said.message;
  EXPECT_NE(said.message.find("Connection closed by peer"), std::string::npos) << said.message;
}

// A store behind a cut link: its calls never return.
class UnreachableStore : public c10d::HashStore {
 public:
  void set(const std::string&, const std::vector<uint8_t>&) override {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
};

TEST(ExplainFailedCollective, ARankThatCannotReachTheStoreSaysItsHostIsCutOffWithinTheWindow) {
  auto store = c10::make_intrusive<UnreachableStore>();
  const auto started = std::chrono::steady_clock::now();
  const CollectiveDiagnosis said = explain_failed_collective(kTimedOut, context(2, 3, store), "host2 10.0.0.3",
                                                             "10.0.0.1:5555", std::chrono::milliseconds(500));
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(2500));
  EXPECT_FALSE(said.reached_store);
  EXPECT_NE(said.message.find("this rank (rank 2 on host2 10.0.0.3) could not reach the rendezvous store at "
                              "10.0.0.1:5555 within 0.5 s either: this host is cut off"),
            std::string::npos) << said.message;
}

TEST(AgreeToGoOn, OneProcessGoesOnOrSaysWhy) {
  EXPECT_NO_THROW(agree_to_go_on("", nullptr));
  try {
    agree_to_go_on("the folder holds another run", nullptr);
    FAIL() << "no error";
  } catch (const AgreedStop& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 refused to start, so no rank starts: the folder holds another run"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace harness::train
