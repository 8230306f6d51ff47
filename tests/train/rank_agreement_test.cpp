// A rank that finds a peer gone names it: from the message the peer left in the store, or rank 0
// when the store (which rank 0 serves) is gone too; other errors pass unchanged.
#include "harness/train/rank_agreement.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

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
