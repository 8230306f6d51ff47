// Joining a run under way through the store (elastic_rendezvous.h), on an in-memory store: the
// askers in order, the generation that admits them, and an asker left waiting.
#include "harness/data_parallel/elastic_rendezvous.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <string>
#include <vector>

namespace harness::data_parallel {
namespace {

TEST(ElasticJoin, RankZeroReadsTheAskersInOrderAndAdmitsThem) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(2));
  EXPECT_TRUE(joins_after(*store, 0).empty());
  EXPECT_EQ(join_count(*store), 0);
  EXPECT_EQ(ask_to_join(*store, {3, 1}), 1);
  EXPECT_EQ(ask_to_join(*store, {4, 5}), 2);
  EXPECT_EQ(join_count(*store), 2);
  EXPECT_EQ(joins_after(*store, 0), (std::vector<JoinRequest>{{3, 1, 1}, {4, 5, 2}}));
  EXPECT_EQ(joins_after(*store, 1), (std::vector<JoinRequest>{{4, 5, 2}}));
  EXPECT_TRUE(joins_after(*store, 2).empty());
  // An asker that died between counting itself and writing its request leaves a gap, which does
  // not hide the requests after it.
  (void)store->add("elastic/joins", 1);
  EXPECT_EQ(ask_to_join(*store, {6, 1}), 4);
  EXPECT_EQ(join_count(*store), 4);
  EXPECT_EQ(joins_after(*store, 2), (std::vector<JoinRequest>{{6, 1, 4}}));

  // Generation 1 lost process 1 (members 0 and 2); generation 2 takes process 3 in its place.
  const Generation now{1, {0, 2}, {0, 2}, {}};
  const Generation next = admit(*store, now, {0, 3, 2}, {0, 1, 2});
  EXPECT_EQ(next.number, 2);
  EXPECT_EQ(next.members, (std::vector<int>{0, 3, 2}));
  EXPECT_EQ(next.joined, (std::vector<int>{3}));
  const Generation seen = await_admission(*store, 3, std::chrono::seconds(1));
  EXPECT_EQ(seen.number, 2);
  EXPECT_EQ(seen.members, next.members);
  EXPECT_EQ(seen.rank_of(3), 1);
  EXPECT_EQ(seen.replicas, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(seen.joined, (std::vector<int>{3}));
}

TEST(ElasticJoin, AnAskerNotAdmittedInTimeIsToldSo) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(2));
  ask_to_join(*store, {5, 1});
  try {
    (void)await_admission(*store, 5, std::chrono::milliseconds(200));
    FAIL() << "admitted without a decision";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("process 5 asked to join and was not admitted within 200 ms"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(admit(*store, Generation{0, {0, 1}, {0, 1}, {}}, {0, 1, 1}, {0, 1, 2}), std::invalid_argument);
  EXPECT_THROW(admit(*store, Generation{0, {0, 1}, {0, 1}, {}}, {0, 1, 2}, {0, 1}), std::invalid_argument);
}

}  // namespace
}  // namespace harness::data_parallel
