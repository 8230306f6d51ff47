// Training that survives a lost rank, as data: what a membership change does to the layout, each
// rank's place in the next generation, and which rows of a step's global batch each replica then
// trains. Every rank computes the same plan from the same inputs (the generation it agreed on and
// the ranks lost); the recovery applies it.
//
// A data-parallel replica is every rank with the same d: its C context ranks, T tensor ranks and
// P stages. A replica that lost any of them cannot train, so a change drops whole replicas; the
// others keep their (c, t, p) and are numbered again by the rank order of layout.h over the
// smaller D. (D, C, T, P) = (3, 1, 1, 2), ranks 0 1 2 | 3 4 5 (stage 0 | stage 1), rank 4 lost:
//
//     replica (original d)   0     1     2
//     ranks, generation 0   0,3   1,4   2,5
//     ranks, generation 1   0,2    -    1,3     (D = 2: rank 2 becomes 1, rank 3 becomes 2, ...)
//
// No example is lost: each step's global batch stays the union of every original replica's batch
// at that step. A member trains its own batch and a contiguous share of the dropped replicas'
// (their rows in order of original replica, split as evenly as rows go, the first members taking
// one more). Each share's loss is normalised by its own replica's label weight, and the averaged
// gradient is scaled by D_now / D_original, so the step's gradient is the undisturbed run's sum.
#pragma once

#include <cstdint>
#include <vector>

#include "harness/parallel/layout.h"

namespace harness::parallel {

// One generation of an elastic run: which of the original data-parallel replicas are in it.
struct Membership {
  int generation = 0;
  int original_replicas = 1;  // D at launch
  LayoutSizes sizes;          // C, T, P and the rest of the run, the same in every generation
  std::vector<int> replicas;  // original replica indices in this generation, ascending

  int replica_count() const { return static_cast<int>(replicas.size()); }
  // This generation's layout: D = replica_count().
  Layout layout() const;
  // The run's layout at launch: D = original_replicas (the ranks replacements ask for).
  Layout original_layout() const;
  // The position in `replicas` of original replica `replica`, or -1 if it is not a member.
  int member_index(int replica) const;
  // The gradient scale that keeps a step's gradient the undisturbed run's: D_now / D_original.
  double gradient_scale() const { return static_cast<double>(replica_count()) / original_replicas; }
};

// Generation 0 of a run of `world_size` ranks in `sizes`' layout (D inferred; every replica).
// Throws as Layout::create does.
Membership initial_membership(int world_size, const LayoutSizes& sizes);

// What a change does: the next generation, the replicas that left or came back, and each rank of
// the generation before it (by its rank there) in the next (-1: it leaves).
struct MembershipChange {
  Membership next;
  std::vector<int> dropped;       // original replica indices that left, ascending
  std::vector<int> joined;        // original replica indices that came back, ascending
  std::vector<int> rank_in_next;  // indexed by rank in the generation before
};

// The generation after `now` when `lost_ranks` (ranks of `now`, in any order, repeats allowed)
// are gone: every replica holding one of them is dropped whole. Throws std::invalid_argument
// naming the rank for one outside `now`'s world, and when no replica would be left.
MembershipChange drop_lost_ranks(const Membership& now, const std::vector<int>& lost_ranks);

// The generation after `now` when replacements for the dropped original replicas `replicas`
// join (their new processes take those replicas' places). Throws std::invalid_argument for a
// replica that is a member already or was never one.
MembershipChange rejoin_replicas(const Membership& now, const std::vector<int>& replicas);

// Which dropped replicas replacements may take back: a replica joins whole, once a replacement
// has asked for every one of its ranks (C x T x P processes). `asked`: the original world ranks
// that replacements waiting to join take (in any order, repeats allowed; ranks of member
// replicas are ignored: their askers wait for a later loss). Returns the original replicas that
// `asked` completes, ascending. (D, C, T, P) = (3, 1, 1, 2), replica 1 (ranks 1 and 4) dropped:
// asked {4} completes none, {4, 1} completes {1}.
std::vector<int> complete_replicas(const Membership& now, const std::vector<int>& asked);

// Rows [begin, end) of original replica `replica`'s batch at a step.
struct RowSlice {
  int replica = 0;
  int64_t begin = 0;
  int64_t end = 0;
  bool operator==(const RowSlice& other) const {
    return replica == other.replica && begin == other.begin && end == other.end;
  }
};

// For each member of `m` (in `m.replicas`' order), the rows it trains at a step in which original
// replica r's batch has `rows[r]` rows (rows.size() == original_replicas): its own batch whole,
// then its share of the dropped replicas' batches. Empty shares are left out. Throws
// std::invalid_argument when rows has the wrong length or a negative count.
std::vector<std::vector<RowSlice>> rows_per_member(const Membership& m, const std::vector<int64_t>& rows);

}  // namespace harness::parallel
