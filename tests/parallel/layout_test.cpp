// The data x context x tensor x pipeline layout against literal tables: coordinates, every group
// of each kind, who reports, the table printed at start, and the refusals with their values.
#include <gtest/gtest.h>

#include <tuple>

#include <stdexcept>
#include <string>
#include <vector>

#include "harness/parallel/layout.h"

namespace harness::parallel {
namespace {

using Groups = std::vector<std::vector<int>>;

// The sizes as the flags give them: --tensor_parallel_size, --pipeline_parallel_size,
// --context_parallel_size.
LayoutSizes sizes(int tensor, int pipeline = 1, int context = 1) {
  LayoutSizes s;
  s.tensor = tensor;
  s.pipeline = pipeline;
  s.context = context;
  return s;
}

// Who prints the per-epoch lines.
std::vector<int> reporting(const Layout& l) {
  std::vector<int> ranks;
  for (int r = 0; r < l.world_size(); ++r) {
    if (l.reports(r)) ranks.push_back(r);
  }
  return ranks;
}

TEST(Layout, TwoByTwoByTwo) {
  const Layout l = Layout::create(8, sizes(2, 2));
  EXPECT_EQ(l.data_parallel_size(), 2);
  EXPECT_EQ(l.tensor_parallel_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(l.data_parallel_groups(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(l.pipeline_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.embedding_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // rank = (p*D + d)*T + t
  const std::vector<Coordinates> coordinates{{0, 0, 0}, {0, 1, 0}, {1, 0, 0}, {1, 1, 0},
                                             {0, 0, 1}, {0, 1, 1}, {1, 0, 1}, {1, 1, 1}};
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(l.coordinates_of(r), coordinates[r]) << r;
    EXPECT_EQ(l.rank_of(coordinates[r]), r);
  }
  EXPECT_EQ(l.data_parallel_group(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(l.tensor_parallel_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(l.pipeline_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(reporting(l), (std::vector<int>{4, 6}));  // last stage, tensor rank 0: d = 0 and d = 1
}

TEST(Layout, OneByTwoByFour) {
  const Layout l = Layout::create(8, sizes(2, 4));
  EXPECT_EQ(l.data_parallel_size(), 1);
  EXPECT_EQ(l.tensor_parallel_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(l.data_parallel_groups(), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(l.pipeline_groups(), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  // Middle stages hold neither wte nor the head.
  EXPECT_EQ(l.embedding_groups(), (Groups{{0, 6}, {1, 7}}));
  EXPECT_TRUE(l.embedding_group(3).empty());
  EXPECT_TRUE(l.is_first_stage(1));
  EXPECT_TRUE(l.is_last_stage(7));
  EXPECT_FALSE(l.is_last_stage(5));
}

TEST(Layout, AVOfStagesPutsTheLossOnTheFirstStage) {
  // (D, T, P) = (2, 2, 2) under zbv: the stages go down the pipeline ranks and back up, so the
  // head and the loss are on pipeline rank 0 with the embedding; wte is on no other rank.
  LayoutSizes v = sizes(2, 2);
  v.loss_on_first_stage = true;
  const Layout l = Layout::create(8, v);
  EXPECT_EQ(l.loss_stage_rank(), 0);
  EXPECT_TRUE(l.is_last_stage(0));
  EXPECT_FALSE(l.is_last_stage(4));
  EXPECT_EQ(l.embedding_groups(), (Groups{{0}, {1}, {2}, {3}}));
  EXPECT_TRUE(l.embedding_group(5).empty());
  EXPECT_EQ(reporting(l), (std::vector<int>{0, 2}));  // pipeline rank 0, tensor rank 0: d = 0 and d = 1
  // The groups themselves are the loop's.
  EXPECT_EQ(l.pipeline_groups(), Layout::create(8, sizes(2, 2)).pipeline_groups());
}

TEST(Layout, FourByOneByTwo) {
  const Layout l = Layout::create(8, sizes(1, 2));
  EXPECT_EQ(l.data_parallel_size(), 4);
  EXPECT_EQ(l.tensor_parallel_groups(), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(l.data_parallel_groups(), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(l.pipeline_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.embedding_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.coordinates_of(6), (Coordinates{2, 0, 1}));
}

// Without a pipeline the layout is the data x tensor one the programs run today: rank = d*T + t.
TEST(Layout, DataByTensorAlone) {
  const Layout l = Layout::create(8, sizes(2));
  EXPECT_EQ(l.tensor_parallel_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(l.data_parallel_groups(), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(l.embedding_group(5), (std::vector<int>{5}));
  for (int r = 0; r < 8; ++r) EXPECT_EQ(l.reports(r), r % 2 == 0) << r;
  const Layout alone = Layout::create(1);
  EXPECT_EQ(alone.pipeline_groups(), (Groups{{0}}));
  EXPECT_TRUE(alone.reports(0));
}

TEST(Layout, CoordinatesTable) {
  EXPECT_EQ(Layout::create(4, sizes(2, 2)).coordinates_table(),
            "layout: data 1 x tensor 2 x pipeline 2 = world 4, rank = (p*D + d)*T + t\n"
            "  rank  data  tensor  pipeline  reports\n"
            "     0     0       0         0  -\n"
            "     1     0       1         0  -\n"
            "     2     0       0         1  Rank 0\n"
            "     3     0       1         1  -\n");
  EXPECT_EQ(Layout::create(2, sizes(1, 1)).coordinates_table(", ZeRO stage 1"),
            "layout: data 2 x tensor 1 x pipeline 1 = world 2, rank = (p*D + d)*T + t, ZeRO stage 1\n"
            "  rank  data  tensor  pipeline  reports\n"
            "     0     0       0         0  Rank 0\n"
            "     1     1       0         0  Rank 1\n");
}

// The four-dimensional tables: rank = ((p*D + d)*C + c)*T + t. Coordinates are {d, t, p, c}.
TEST(Layout, DataTwoContextTwo) {  // (D, C, T, P) = (2, 2, 1, 1)
  const Layout l = Layout::create(4, sizes(1, 1, 2));
  EXPECT_EQ(l.data_parallel_size(), 2);
  EXPECT_EQ(l.context_parallel_size(), 2);
  EXPECT_EQ(l.gradient_group_size(), 4);
  EXPECT_EQ(l.context_parallel_groups(), (Groups{{0, 1}, {2, 3}}));
  EXPECT_EQ(l.data_parallel_groups(), (Groups{{0, 2}, {1, 3}}));
  EXPECT_EQ(l.tensor_parallel_groups(), (Groups{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(l.pipeline_groups(), (Groups{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(l.gradient_groups(), (Groups{{0, 1, 2, 3}}));
  EXPECT_EQ(l.embedding_groups(), (Groups{{0}, {1}, {2}, {3}}));
  const std::vector<Coordinates> coordinates{{0, 0, 0, 0}, {0, 0, 0, 1}, {1, 0, 0, 0}, {1, 0, 0, 1}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(l.coordinates_of(r), coordinates[r]) << r;
    EXPECT_EQ(l.rank_of(coordinates[r]), r);
  }
  EXPECT_EQ(reporting(l), (std::vector<int>{0, 2}));  // c = 0 of each replica
}

TEST(Layout, ContextTwoTensorTwoPipelineTwo) {  // (D, C, T, P) = (1, 2, 2, 2)
  const Layout l = Layout::create(8, sizes(2, 2, 2));
  EXPECT_EQ(l.data_parallel_size(), 1);
  EXPECT_EQ(l.tensor_parallel_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(l.context_parallel_groups(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(l.data_parallel_groups(), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(l.gradient_groups(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(l.pipeline_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.embedding_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  const std::vector<Coordinates> coordinates{{0, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 0, 1}, {0, 1, 0, 1},
                                             {0, 0, 1, 0}, {0, 1, 1, 0}, {0, 0, 1, 1}, {0, 1, 1, 1}};
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(l.coordinates_of(r), coordinates[r]) << r;
    EXPECT_EQ(l.rank_of(coordinates[r]), r);
  }
  EXPECT_EQ(reporting(l), (std::vector<int>{4}));
  EXPECT_EQ(l.coordinates_table(),
            "layout: data 1 x context 2 x tensor 2 x pipeline 2 = world 8, rank = ((p*D + d)*C + c)*T + t\n"
            "  rank  data  context  tensor  pipeline  reports\n"
            "     0     0        0       0         0  -\n"
            "     1     0        0       1         0  -\n"
            "     2     0        1       0         0  -\n"
            "     3     0        1       1         0  -\n"
            "     4     0        0       0         1  Rank 0\n"
            "     5     0        0       1         1  -\n"
            "     6     0        1       0         1  -\n"
            "     7     0        1       1         1  -\n");
}

TEST(Layout, DataTwoTensorTwoPipelineTwoHasNoContextDimension) {  // (D, C, T, P) = (2, 1, 2, 2)
  const Layout l = Layout::create(8, sizes(2, 2, 1));
  EXPECT_EQ(l.context_parallel_groups(), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(l.data_parallel_groups(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  // Without a context dimension, gradients are averaged over the data-parallel group.
  EXPECT_EQ(l.gradient_groups(), l.data_parallel_groups());
  EXPECT_EQ(l.tensor_parallel_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(l.pipeline_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.rank_of({1, 1, 1, 0}), 7);
  EXPECT_EQ(reporting(l), (std::vector<int>{4, 6}));
}

TEST(Layout, OneRank) {  // (D, C, T, P) = (1, 1, 1, 1)
  const Layout l = Layout::create(1);
  for (const Groups& groups : {l.data_parallel_groups(), l.context_parallel_groups(), l.tensor_parallel_groups(),
                               l.pipeline_groups(), l.gradient_groups(), l.embedding_groups()}) {
    EXPECT_EQ(groups, (Groups{{0}}));
  }
  EXPECT_EQ(l.coordinates_of(0), (Coordinates{0, 0, 0, 0}));
  EXPECT_EQ(reporting(l), (std::vector<int>{0}));
  EXPECT_EQ(l.sizes_text(), "data 1 x tensor 1 x pipeline 1 = world 1");
}

void expect_refused(int world, const LayoutSizes& refused, const std::string& message) {
  try {
    (void)Layout::create(world, refused);
    ADD_FAILURE() << "expected an error containing: " << message;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

void expect_refused(int world, int t, int p, const std::string& message, int c = 1) {
  expect_refused(world, sizes(t, p, c), message);
}

// --sequence_parallel splits what the tensor group holds, and needs one; pipeline stages pass each
// tensor rank's part between them.
TEST(Layout, SequenceParallelNeedsTensorRanks) {
  LayoutSizes with = sizes(2, 1, 2);
  with.sequence_parallel = true;
  const Layout l = Layout::create(8, with);
  EXPECT_TRUE(l.sequence_parallel());
  EXPECT_EQ(l.data_parallel_size(), 2);
  EXPECT_EQ(l.tensor_parallel_group(5), (std::vector<int>{4, 5}));  // the rank order is unchanged
  EXPECT_FALSE(Layout::create(8, sizes(2, 1, 2)).sequence_parallel());
  LayoutSizes staged = sizes(2, 2);
  staged.sequence_parallel = true;
  const Layout p = Layout::create(8, staged);
  EXPECT_TRUE(p.sequence_parallel());
  EXPECT_EQ(p.pipeline_parallel_size(), 2);
  EXPECT_EQ(p.tensor_parallel_group(6), (std::vector<int>{6, 7}));
  LayoutSizes bad = sizes(1, 1);
  bad.sequence_parallel = true;
  expect_refused(4, bad,
                 "--sequence_parallel splits the sequence over the tensor-parallel group: it needs "
                 "--tensor_parallel_size 2 or more, not 1");
}

TEST(Layout, RefusalsNameTheFlagsAndValues) {
  expect_refused(6, 4, 1, "--world_size 6 is not divisible by --tensor_parallel_size 4");
  expect_refused(6, 2, 2,
                 "--world_size 6 is not divisible by --tensor_parallel_size 2 x --pipeline_parallel_size 2 = 4");
  expect_refused(0, 1, 1, "--world_size 0 must be at least 1");
  expect_refused(4, 0, 1, "--tensor_parallel_size 0 must be at least 1");
  expect_refused(4, 1, -1, "--pipeline_parallel_size -1 must be at least 1");
  expect_refused(4, 1, 1, "--context_parallel_size 0 must be at least 1", 0);
  expect_refused(6, 1, 1,
                 "--world_size 6 is not divisible by --context_parallel_size 4 x --tensor_parallel_size 1 = 4 "
                 "(world size = data-parallel x context-parallel x tensor-parallel size)", 4);
  expect_refused(12, 2, 2,
                 "--world_size 12 is not divisible by --context_parallel_size 2 x --tensor_parallel_size 2 x "
                 "--pipeline_parallel_size 2 = 8 (world size = data-parallel x context-parallel x tensor-parallel x "
                 "pipeline-parallel size)", 2);
  // ZeRO shards each pipeline stage's and each tensor-parallel shard's state over its data-parallel
  // group (train/plan/plan.h holds the stage).
  EXPECT_EQ(Layout::create(4, sizes(1, 2)).data_parallel_size(), 2);
  EXPECT_EQ(Layout::create(4, sizes(1, 1)).data_parallel_size(), 4);
  EXPECT_EQ(Layout::create(4, sizes(2, 1)).data_parallel_size(), 2);
  EXPECT_EQ(Layout::create(8, sizes(2, 2)).data_parallel_size(), 2);
  const Layout l = Layout::create(4, sizes(2));
  EXPECT_THROW(l.coordinates_of(4), std::invalid_argument);
  EXPECT_THROW(l.rank_of({0, 2, 0}), std::invalid_argument);
  EXPECT_THROW(l.rank_of({0, 0, 0, 1}), std::invalid_argument);  // no context dimension here
}

}  // namespace
}  // namespace harness::parallel
