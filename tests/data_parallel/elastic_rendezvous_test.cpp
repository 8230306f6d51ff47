// Joining a run under way through the store (elastic_rendezvous.h), on an in-memory store: the
// askers in order, the generation that admits them, and an asker left waiting. And a step's commit
// vote, with members that vote, call the step off, or are lost before or after voting. And heartbeats,
// which tell a lost member where no launcher records it.
#include "harness/data_parallel/elastic_rendezvous.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace harness::data_parallel {
namespace {

// Without a launcher to record losses (torchrun across hosts), a heartbeat that stands still is a
// loss: a beating member is never lost, a silent one is once it stood still for the window, and
// one that never beat is judged by the launcher's record alone.
TEST(ElasticHeartbeat, AMemberWhoseBeatStandsStillIsLostAndOneThatBeatsIsNot) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  LossWatch watch(std::chrono::milliseconds(300));
  auto beat = std::make_unique<Heartbeat>(store, 1, std::chrono::milliseconds(20));
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(700);
  while (std::chrono::steady_clock::now() < until) {
    EXPECT_FALSE(watch.lost(*store, 1));
    EXPECT_FALSE(watch.lost(*store, 2));  // never beat, not recorded lost
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  beat.reset();  // its process is gone: the count stands still from here
  const auto stopped = std::chrono::steady_clock::now();
  while (!watch.lost(*store, 1)) {
    ASSERT_LT(std::chrono::steady_clock::now() - stopped, std::chrono::seconds(3));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(std::chrono::steady_clock::now() - stopped, std::chrono::milliseconds(250));
  EXPECT_FALSE(watch.lost(*store, 2));
  store->set(lost_process_key(2), std::vector<uint8_t>{'x'});
  EXPECT_TRUE(watch.lost(*store, 2));
}

// The survivors of a lost host agree without it once its beat stands still, well before the join
// window ends.
TEST(ElasticHeartbeat, TheNextGenerationLeavesASilentMemberOutBeforeTheWindowEnds) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(30));
  Generation now;
  now.members = {0, 1, 2};
  std::vector<std::unique_ptr<Heartbeat>> beats;
  for (int member : now.members) beats.push_back(std::make_unique<Heartbeat>(store, member));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  beats[2].reset();  // host2 lost
  const auto started = std::chrono::steady_clock::now();
  auto other = std::async(std::launch::async, [&] {
    return agree_next_generation(*store, now, 1, std::chrono::seconds(20));
  });
  const Generation next = agree_next_generation(*store, now, 0, std::chrono::seconds(20));
  EXPECT_EQ(next.members, (std::vector<int>{0, 1}));
  EXPECT_EQ(other.get().members, (std::vector<int>{0, 1}));
  EXPECT_LT(std::chrono::steady_clock::now() - started, kHeartbeatStaleAfter + std::chrono::seconds(2));
}

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

// Generation 1 of members 0, 1 and 2 votes on step 4 (the fifth); each member a thread here, as
// each is a process in a run.
const Generation kThree{1, {0, 1, 2}, {0, 1, 2}, {}};
constexpr std::chrono::milliseconds kVoteTimeout = std::chrono::seconds(20);

c10::intrusive_ptr<c10d::HashStore> vote_store() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(30));
  return store;
}

std::future<StepDecision> vote_aside(c10d::Store& store, int member) {
  return std::async(std::launch::async, [&store, member] { return vote_to_commit(store, kThree, 4, member, kVoteTimeout); });
}

// Until `votes` members have voted on step 4.
void until_voted(c10d::Store& store, int64_t votes) {
  while (store.add("elastic/gen1/step4/votes", 0) < votes) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

TEST(ElasticCommit, TheLastVoteCommitsForEveryMemberAndClearsTheStepBefore) {
  auto store = vote_store();
  (void)store->add("elastic/gen1/step3/votes", 3);
  store->set("elastic/gen1/step3/decision", std::vector<uint8_t>{'c'});
  std::future<StepDecision> first = vote_aside(*store, 1), second = vote_aside(*store, 2);
  until_voted(*store, 2);
  EXPECT_EQ(vote_to_commit(*store, kThree, 4, 0, kVoteTimeout), StepDecision::kCommit);
  EXPECT_EQ(first.get(), StepDecision::kCommit);
  EXPECT_EQ(second.get(), StepDecision::kCommit);
  EXPECT_FALSE(store->check({"elastic/gen1/step3/votes"}));
  EXPECT_FALSE(store->check({"elastic/gen1/step3/decision"}));
  EXPECT_TRUE(store->check({"elastic/gen1/step4/decision"}));
}

TEST(ElasticCommit, AMemberWhoseStepFailedMakesEveryVoterTakeItAgain) {
  auto store = vote_store();
  std::future<StepDecision> first = vote_aside(*store, 0), second = vote_aside(*store, 1);
  until_voted(*store, 2);
  call_off_step(*store, kThree, 4, 2);
  EXPECT_EQ(first.get(), StepDecision::kRetake);
  EXPECT_EQ(second.get(), StepDecision::kRetake);
  EXPECT_NO_THROW(call_off_step(*store, kThree, 4, 0));  // a second failure: the same decision
}

TEST(ElasticCommit, AMemberLostBeforeVotingMakesTheVotersTakeTheStepAgain) {
  auto store = vote_store();
  std::future<StepDecision> first = vote_aside(*store, 0), second = vote_aside(*store, 1);
  until_voted(*store, 2);
  store->set(lost_process_key(2), std::vector<uint8_t>{'x'});
  EXPECT_EQ(first.get(), StepDecision::kRetake);
  EXPECT_EQ(second.get(), StepDecision::kRetake);
}

TEST(ElasticCommit, AMemberLostAfterTheLastVoteLeavesTheStepCommitted) {
  auto store = vote_store();
  std::future<StepDecision> first = vote_aside(*store, 0), second = vote_aside(*store, 1);
  until_voted(*store, 2);
  EXPECT_EQ(vote_to_commit(*store, kThree, 4, 2, kVoteTimeout), StepDecision::kCommit);
  store->set(lost_process_key(2), std::vector<uint8_t>{'x'});
  EXPECT_EQ(first.get(), StepDecision::kCommit);
  EXPECT_EQ(second.get(), StepDecision::kCommit);
  EXPECT_THROW(call_off_step(*store, kThree, 4, 0), std::logic_error);
}

TEST(ElasticCommit, AVoteAfterTheStepWasCalledOffCannotCommitIt) {
  auto store = vote_store();
  // Member 2 votes and is lost while waiting; member 0 finds it lost and calls the step off; member
  // 1's vote then completes the count, and still the step is taken again.
  std::future<StepDecision> lost = vote_aside(*store, 2);
  until_voted(*store, 1);
  store->set(lost_process_key(2), std::vector<uint8_t>{'x'});
  EXPECT_EQ(vote_to_commit(*store, kThree, 4, 0, kVoteTimeout), StepDecision::kRetake);
  EXPECT_EQ(vote_to_commit(*store, kThree, 4, 1, kVoteTimeout), StepDecision::kRetake);
  EXPECT_EQ(lost.get(), StepDecision::kRetake);
}

TEST(ElasticCommit, AVoterLeftAloneIsToldSoAtItsTimeout) {
  auto store = vote_store();
  try {
    (void)vote_to_commit(*store, kThree, 4, 1, std::chrono::milliseconds(200));
    FAIL() << "a decision without the other votes";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("process 1 voted to commit step 5 of generation 1, and within 200 ms no "
                                         "decision came and no member was recorded lost"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace harness::data_parallel
