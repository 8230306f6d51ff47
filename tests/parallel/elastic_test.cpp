// Membership changes of an elastic run against literal tables: which replicas a lost rank drops,
// where every other rank goes, which rows each replica then trains, and the refusals.
#include "harness/parallel/elastic.h"

#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <vector>

namespace harness::parallel {
namespace {

using Rows = std::vector<RowSlice>;

LayoutSizes pipeline_of(int stages) {
  LayoutSizes sizes;
  sizes.pipeline = stages;
  return sizes;
}

TEST(ElasticMembership, TwoReplicasLoseOneAndTheOtherGoesOnAlone) {
  const Membership start = initial_membership(2, {});
  EXPECT_EQ(start.replicas, (std::vector<int>{0, 1}));
  const MembershipChange change = drop_lost_ranks(start, {1});
  EXPECT_EQ(change.next.generation, 1);
  EXPECT_EQ(change.next.replicas, (std::vector<int>{0}));
  EXPECT_EQ(change.dropped, (std::vector<int>{1}));
  EXPECT_TRUE(change.joined.empty());
  EXPECT_EQ(change.rank_in_next, (std::vector<int>{0, -1}));
  EXPECT_EQ(change.next.layout().world_size(), 1);
  EXPECT_DOUBLE_EQ(change.next.gradient_scale(), 0.5);
}

TEST(ElasticMembership, ThreeReplicasLoseTheFirstAndTheOthersMoveDown) {
  const MembershipChange change = drop_lost_ranks(initial_membership(3, {}), {0});
  EXPECT_EQ(change.next.replicas, (std::vector<int>{1, 2}));
  EXPECT_EQ(change.rank_in_next, (std::vector<int>{-1, 0, 1}));
  EXPECT_DOUBLE_EQ(change.next.gradient_scale(), 2.0 / 3.0);
}

// elastic.h's table: (D, C, T, P) = (3, 1, 1, 2), rank 4 (replica 1's second stage) lost.
TEST(ElasticMembership, ALostStageDropsItsWholeReplica) {
  const MembershipChange change = drop_lost_ranks(initial_membership(6, pipeline_of(2)), {4});
  EXPECT_EQ(change.dropped, (std::vector<int>{1}));
  EXPECT_EQ(change.next.replicas, (std::vector<int>{0, 2}));
  EXPECT_EQ(change.rank_in_next, (std::vector<int>{0, -1, 1, 2, -1, 3}));
  const Layout next = change.next.layout();
  EXPECT_EQ(next.data_parallel_size(), 2);
  EXPECT_EQ(next.pipeline_groups(), (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
}

// (D, C, T, P) = (2, 1, 2, 2): ranks 0..7 as layout.h draws them. Rank 3 (replica 1, stage 0,
// tensor 1) lost: replica 1 (ranks 2, 3, 6, 7) leaves; replica 0 becomes the world of 4.
TEST(ElasticMembership, ALostTensorRankDropsItsWholeReplica) {
  LayoutSizes sizes = pipeline_of(2);
  sizes.tensor = 2;
  const MembershipChange change = drop_lost_ranks(initial_membership(8, sizes), {3});
  EXPECT_EQ(change.next.replicas, (std::vector<int>{0}));
  EXPECT_EQ(change.rank_in_next, (std::vector<int>{0, 1, -1, -1, 2, 3, -1, -1}));
}

TEST(ElasticMembership, SeveralLostRanksAndRepeatsDropEachReplicaOnce) {
  const MembershipChange change = drop_lost_ranks(initial_membership(8, pipeline_of(2)), {5, 1, 5, 3});
  // D = 4: stage 0 ranks 0..3, stage 1 ranks 4..7; ranks 1 and 5 are replica 1, rank 3 replica 3.
  EXPECT_EQ(change.dropped, (std::vector<int>{1, 3}));
  EXPECT_EQ(change.next.replicas, (std::vector<int>{0, 2}));
  EXPECT_EQ(change.rank_in_next, (std::vector<int>{0, -1, 1, -1, 2, -1, 3, -1}));
}

TEST(ElasticMembership, ASecondLossCountsRanksOfTheGenerationItHappensIn) {
  const MembershipChange first = drop_lost_ranks(initial_membership(4, {}), {1});
  // Generation 1 is replicas 0, 2, 3 at ranks 0, 1, 2: its rank 1 is original replica 2.
  const MembershipChange second = drop_lost_ranks(first.next, {1});
  EXPECT_EQ(second.next.generation, 2);
  EXPECT_EQ(second.dropped, (std::vector<int>{2}));
  EXPECT_EQ(second.next.replicas, (std::vector<int>{0, 3}));
  EXPECT_EQ(second.rank_in_next, (std::vector<int>{0, -1, 1}));
}

TEST(ElasticMembership, AReplacementTakesItsReplicasPlaceBack) {
  const MembershipChange lost = drop_lost_ranks(initial_membership(6, pipeline_of(2)), {4});
  const MembershipChange back = rejoin_replicas(lost.next, {1});
  EXPECT_EQ(back.next.generation, 2);
  EXPECT_EQ(back.joined, (std::vector<int>{1}));
  EXPECT_EQ(back.next.replicas, (std::vector<int>{0, 1, 2}));
  // Generation 1's ranks 0, 1, 2, 3 (replicas 0, 2 at stages 0 and 1) go back to 0, 2, 3, 5.
  EXPECT_EQ(back.rank_in_next, (std::vector<int>{0, 2, 3, 5}));
  EXPECT_DOUBLE_EQ(back.next.gradient_scale(), 1.0);
}

TEST(ElasticMembership, ReplacementsTakeAReplicaBackOnlyOnceEveryRankOfItAsked) {
  // (D, C, T, P) = (3, 1, 1, 2): replica d holds ranks d and 3 + d.
  const Membership one_lost = drop_lost_ranks(initial_membership(6, pipeline_of(2)), {4}).next;
  EXPECT_EQ(complete_replicas(one_lost, {}), (std::vector<int>{}));
  EXPECT_EQ(complete_replicas(one_lost, {4}), (std::vector<int>{}));
  EXPECT_EQ(complete_replicas(one_lost, {4, 1}), (std::vector<int>{1}));
  EXPECT_EQ(complete_replicas(one_lost, {1, 4, 4, 1}), (std::vector<int>{1}));  // asked twice: once
  // Ranks of member replicas wait for a later loss.
  EXPECT_EQ(complete_replicas(one_lost, {0, 3}), (std::vector<int>{}));
  EXPECT_EQ(complete_replicas(one_lost, {0, 3, 4, 1}), (std::vector<int>{1}));
  // Replicas 0 and 2 dropped: each joins when whole, in order of replica.
  const Membership two_lost = drop_lost_ranks(initial_membership(6, pipeline_of(2)), {0, 5}).next;
  EXPECT_EQ(two_lost.replicas, (std::vector<int>{1}));
  EXPECT_EQ(complete_replicas(two_lost, {5, 0, 2}), (std::vector<int>{2}));
  EXPECT_EQ(complete_replicas(two_lost, {5, 0, 2, 3}), (std::vector<int>{0, 2}));
  // (D, C, T, P) = (2, 2, 2, 1): replica 1 is ranks 4 to 7 (rank = (d*C + c)*T + t).
  LayoutSizes four;
  four.context = 2;
  four.tensor = 2;
  const Membership cut = drop_lost_ranks(initial_membership(8, four), {6}).next;
  EXPECT_EQ(complete_replicas(cut, {7, 6, 4}), (std::vector<int>{}));
  EXPECT_EQ(complete_replicas(cut, {7, 6, 4, 5}), (std::vector<int>{1}));
  // One replica a process: a replacement completes its replica alone.
  EXPECT_EQ(complete_replicas(drop_lost_ranks(initial_membership(3, {}), {1}).next, {1}), (std::vector<int>{1}));
  EXPECT_THROW(complete_replicas(cut, {8}), std::invalid_argument);
}

TEST(ElasticMembership, RefusalsNameTheRankOrTheReplica) {
  const Membership start = initial_membership(2, {});
  EXPECT_THROW(drop_lost_ranks(start, {2}), std::invalid_argument);
  EXPECT_THROW(drop_lost_ranks(start, {-1}), std::invalid_argument);
  try {
    drop_lost_ranks(start, {0, 1});
    FAIL() << "losing every replica must be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("none is left"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rejoin_replicas(start, {1}), std::invalid_argument);  // a member already
  EXPECT_THROW(rejoin_replicas(drop_lost_ranks(start, {1}).next, {2}), std::invalid_argument);  // never one
  EXPECT_THROW(rows_per_member(start, {8}), std::invalid_argument);
  EXPECT_THROW(rows_per_member(start, {8, -1}), std::invalid_argument);
}

TEST(ElasticRows, EveryReplicaTrainsItsOwnBatchWhileAllAreMembers) {
  EXPECT_EQ(rows_per_member(initial_membership(3, {}), {8, 8, 5}),
            (std::vector<Rows>{{{0, 0, 8}}, {{1, 0, 8}}, {{2, 0, 5}}}));
}

TEST(ElasticRows, TheSurvivorsShareTheDroppedReplicasRows) {
  const Membership two_of_three = drop_lost_ranks(initial_membership(3, {}), {1}).next;
  EXPECT_EQ(rows_per_member(two_of_three, {8, 8, 8}),
            (std::vector<Rows>{{{0, 0, 8}, {1, 0, 4}}, {{2, 0, 8}, {1, 4, 8}}}));
  // An odd count: the first member takes one more. A short last batch the same way.
  EXPECT_EQ(rows_per_member(two_of_three, {8, 5, 8}),
            (std::vector<Rows>{{{0, 0, 8}, {1, 0, 3}}, {{2, 0, 8}, {1, 3, 5}}}));
  // The last batch of an epoch can leave a replica nothing: no empty slice.
  EXPECT_EQ(rows_per_member(two_of_three, {1, 1, 0}), (std::vector<Rows>{{{0, 0, 1}, {1, 0, 1}}, {}}));
}

TEST(ElasticRows, TwoDroppedReplicasAreLaidEndToEndAndSplitInOrder) {
  const Membership two_of_five = drop_lost_ranks(initial_membership(5, {}), {1, 3, 4}).next;
  EXPECT_EQ(two_of_five.replicas, (std::vector<int>{0, 2}));
  // 6 + 6 + 3 = 15 orphaned rows: the first member 8 (replica 1's 6, replica 3's first 2), the
  // second 7 (replica 3's last 4, replica 4's 3).
  EXPECT_EQ(rows_per_member(two_of_five, {6, 6, 6, 6, 3}),
            (std::vector<Rows>{{{0, 0, 6}, {1, 0, 6}, {3, 0, 2}}, {{2, 0, 6}, {3, 2, 6}, {4, 0, 3}}}));
}

// Whatever is lost, each step's rows are every original replica's batch exactly once.
TEST(ElasticRows, EveryRowOfEveryReplicaIsTrainedExactlyOnce) {
  for (int D = 2; D <= 6; ++D) {
    for (int mask = 1; mask < (1 << D) - 1; ++mask) {
      std::vector<int> lost;
      for (int r = 0; r < D; ++r) {
        if (mask & (1 << r)) lost.push_back(r);
      }
      const Membership m = drop_lost_ranks(initial_membership(D, {}), lost).next;
      std::vector<int64_t> rows(D);
      for (int r = 0; r < D; ++r) rows[r] = (r * 7 + 3) % 9;
      std::vector<std::vector<int>> seen(D);
      for (int r = 0; r < D; ++r) seen[r].assign(rows[r], 0);
      const std::vector<Rows> plan = rows_per_member(m, rows);
      ASSERT_EQ(plan.size(), m.replicas.size());
      int64_t most = 0, least = -1;
      for (const Rows& member : plan) {
        int64_t share = 0;
        for (const RowSlice& s : member) {
          ASSERT_LT(s.begin, s.end);
          for (int64_t i = s.begin; i < s.end; ++i) ++seen[s.replica].at(i);
          if (m.member_index(s.replica) < 0) share += s.end - s.begin;
        }
        most = std::max(most, share);
        least = least < 0 ? share : std::min(least, share);
      }
      for (int r = 0; r < D; ++r) {
        for (int64_t i = 0; i < rows[r]; ++i) EXPECT_EQ(seen[r][i], 1) << "D " << D << " mask " << mask << " replica " << r;
      }
      EXPECT_LE(most - least, 1) << "D " << D << " mask " << mask;
    }
  }
}

}  // namespace
}  // namespace harness::parallel
