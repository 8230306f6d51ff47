// How a run's processes split the work: data x context x tensor x pipeline parallelism, the
// geometry of a run's plan (train/plan/plan.h), and every rank's coordinates and groups as plain rank
// lists (process_groups.h builds the c10d groups from them).
//
// Rank order, tensor fastest, then context, then data, then pipeline (Megatron's tp-cp-dp-pp):
//
//     rank = ((p * D + d) * C + c) * T + t
//
// so the ranks of one tensor-parallel group, which talk in every layer, are neighbours (one node),
// the context ranks that pass keys and values round a ring in every attention come next, and a
// pipeline stage is a contiguous block of D * C * T ranks. (D, C, T, P) = (2, 1, 2, 2):
//
//     rank  0 1 2 3 | 4 5 6 7
//     p     0 0 0 0 | 1 1 1 1
//     d     0 0 1 1 | 0 0 1 1
//     t     0 1 0 1 | 0 1 0 1
//
//     tensor-parallel groups (same p, d, c)  {0,1} {2,3} {4,5} {6,7}
//     data-parallel groups   (same p, c, t)  {0,2} {1,3} {4,6} {5,7}
//     pipeline groups        (same d, c, t)  {0,4} {1,5} {2,6} {3,7}   (ordered by stage)
//     embedding groups: the first and last stage of each pipeline group, which hold the tied wte
//     and head and sum their gradients (the pipeline group itself when P = 2; the rank alone when
//     P = 1).
//
// With C > 1 each replica's sequences are split over its context group (same p, d, t), and the
// gradients of one (p, t) slice of the model are averaged over the D * C ranks that hold it: the
// gradient group (same p, t), which is the data-parallel group when C = 1.
#pragma once

#include <string>
#include <vector>

namespace harness::parallel {

// What a rank is in the layout: its position in each dimension.
struct Coordinates {
  int data = 0;      // d: which replica of the model
  int tensor = 0;    // t: which slice of each layer
  int pipeline = 0;  // p: which stage
  int context = 0;   // c: which chunks of each sequence
  bool operator==(const Coordinates& other) const {
    return data == other.data && tensor == other.tensor && pipeline == other.pipeline && context == other.context;
  }
};

// The sizes a run asks for (the flags); the data-parallel size is what the world leaves.
struct LayoutSizes {
  int tensor = 1;    // --tensor_parallel_size
  int context = 1;   // --context_parallel_size
  int pipeline = 1;  // --pipeline_parallel_size
  bool sequence_parallel = false;  // --sequence_parallel: T > 1 splits the sequence between its layers too
  // --pipeline_schedule zbv: the stages go down the pipeline ranks and back up (a V), so the
  // model's last stage, with the head and the loss, is on pipeline rank 0 beside the embedding.
  bool loss_on_first_stage = false;
};

class Layout {
 public:
  // World size = D * C * T * P with D inferred. Throws std::invalid_argument naming the flags and
  // their values: a size below 1, a world size that C * T * P does not divide, or sequence
  // parallelism without T > 1. (train/plan/plan.h holds the rest of a run's choices.)
  static Layout create(int world_size, const LayoutSizes& sizes = {});

  int world_size() const { return data_ * context_ * tensor_ * pipeline_; }
  int data_parallel_size() const { return data_; }
  int context_parallel_size() const { return context_; }
  int tensor_parallel_size() const { return tensor_; }
  int pipeline_parallel_size() const { return pipeline_; }
  // The ranks gradients are averaged over, and ZeRO shards over: D * C.
  int gradient_group_size() const { return data_ * context_; }
  // Megatron's sequence parallelism over each tensor-parallel group (--sequence_parallel).
  bool sequence_parallel() const { return sequence_parallel_; }

  // rank = ((p * D + d) * C + c) * T + t. Throw std::invalid_argument for coordinates or a rank
  // outside.
  int rank_of(const Coordinates& c) const;
  Coordinates coordinates_of(int rank) const;

  // The world ranks of `rank`'s groups, ordered by position in the group (so a rank's index in
  // its data-parallel group is its d, in its context group its c, in its tensor-parallel group
  // its t, in its pipeline group its p, and in its gradient group d * C + c).
  std::vector<int> data_parallel_group(int rank) const;     // same (p, c, t)
  std::vector<int> context_parallel_group(int rank) const;  // same (p, d, t)
  std::vector<int> tensor_parallel_group(int rank) const;   // same (p, d, c)
  std::vector<int> pipeline_group(int rank) const;          // same (d, c, t)
  std::vector<int> gradient_group(int rank) const;          // same (p, t): data x context
  // The first and last stage of `rank`'s pipeline group (one rank when P = 1, or when the loss is
  // on the first stage); empty for a rank of a middle stage, which holds neither wte nor the head.
  std::vector<int> embedding_group(int rank) const;

  // Every group of a kind, in a fixed order (by the lowest rank in each): the literal tables.
  std::vector<std::vector<int>> data_parallel_groups() const;
  std::vector<std::vector<int>> context_parallel_groups() const;
  std::vector<std::vector<int>> tensor_parallel_groups() const;
  std::vector<std::vector<int>> pipeline_groups() const;
  std::vector<std::vector<int>> gradient_groups() const;
  std::vector<std::vector<int>> embedding_groups() const;

  bool is_first_stage(int rank) const { return coordinates_of(rank).pipeline == 0; }
  // Whether `rank` runs the model's last stage (the head and the loss): pipeline rank P - 1, or 0
  // with loss_on_first_stage.
  bool is_last_stage(int rank) const { return coordinates_of(rank).pipeline == loss_stage_rank(); }
  int loss_stage_rank() const { return loss_on_first_stage_ ? 0 : pipeline_ - 1; }
  // Whether `rank` prints its replica's per-epoch lines (the last stage's context rank 0 and
  // tensor rank 0, one per data-parallel rank, which stands for the replica as `Rank {d}`).
  bool reports(int rank) const;

  // "data 2 x tensor 2 x pipeline 2 = world 8" ("data 2 x context 2 x tensor 1 x pipeline 1 =
  // world 4" when C > 1)
  std::string sizes_text() const;
  // The coordinates of every rank, one line each under a header, as the program prints them at
  // start; `note` ends the header (the plan's ", ZeRO stage 1").
  std::string coordinates_table(const std::string& note = "") const;

 private:
  Layout(int data, const LayoutSizes& sizes)
      : data_(data), context_(sizes.context), tensor_(sizes.tensor), pipeline_(sizes.pipeline),
        sequence_parallel_(sizes.sequence_parallel),
        loss_on_first_stage_(sizes.loss_on_first_stage) {}
  void check_rank(int rank) const;
  // The ranks that share every coordinate of `rank` but `axis`, by that coordinate.
  std::vector<int> group_along(int rank, int Coordinates::*axis, int size) const;

  int data_ = 1;
  int context_ = 1;
  int tensor_ = 1;
  int pipeline_ = 1;
  bool sequence_parallel_ = false;
  bool loss_on_first_stage_ = false;
};

}  // namespace harness::parallel
