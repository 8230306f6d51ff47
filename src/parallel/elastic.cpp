// Membership changes of an elastic run (see elastic.h).
#include "harness/parallel/elastic.h"

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

namespace harness::parallel {
namespace {

int ranks_per_replica(const LayoutSizes& sizes) { return sizes.context * sizes.tensor * sizes.pipeline; }

// Every rank of `before` in `after`, where each member replica keeps its (c, t, p).
std::vector<int> ranks_in(const Membership& before, const Membership& after) {
  const Layout from = before.layout(), to = after.layout();
  std::vector<int> out(from.world_size(), -1);
  for (int rank = 0; rank < from.world_size(); ++rank) {
    Coordinates c = from.coordinates_of(rank);
    const int d = after.member_index(before.replicas.at(c.data));
    if (d < 0) continue;
    c.data = d;
    out[rank] = to.rank_of(c);
  }
  return out;
}

}  // namespace

Layout Membership::layout() const {
  return Layout::create(replica_count() * ranks_per_replica(sizes), sizes);
}

Layout Membership::original_layout() const {
  return Layout::create(original_replicas * ranks_per_replica(sizes), sizes);
}

int Membership::member_index(int replica) const {
  const auto it = std::find(replicas.begin(), replicas.end(), replica);
  return it == replicas.end() ? -1 : static_cast<int>(it - replicas.begin());
}

Membership initial_membership(int world_size, const LayoutSizes& sizes) {
  const Layout layout = Layout::create(world_size, sizes);
  Membership m;
  m.original_replicas = layout.data_parallel_size();
  m.sizes = sizes;
  for (int d = 0; d < m.original_replicas; ++d) m.replicas.push_back(d);
  return m;
}

MembershipChange drop_lost_ranks(const Membership& now, const std::vector<int>& lost_ranks) {
  const Layout layout = now.layout();
  std::set<int> dropped;
  for (const int rank : lost_ranks) {
    if (rank < 0 || rank >= layout.world_size()) {
      throw std::invalid_argument("elastic: lost rank " + std::to_string(rank) + " is not in generation " +
                                  std::to_string(now.generation) + " (world size " +
                                  std::to_string(layout.world_size()) + ")");
    }
    dropped.insert(now.replicas.at(layout.coordinates_of(rank).data));
  }
  MembershipChange change;
  change.next = now;
  change.next.generation = now.generation + 1;
  change.next.replicas.clear();
  for (const int r : now.replicas) {
    if (!dropped.count(r)) change.next.replicas.push_back(r);
  }
  if (change.next.replicas.empty()) {
    throw std::invalid_argument("elastic: generation " + std::to_string(now.generation) +
                                " lost a rank of every replica; none is left to continue");
  }
  change.dropped.assign(dropped.begin(), dropped.end());
  change.rank_in_next = ranks_in(now, change.next);
  return change;
}

MembershipChange rejoin_replicas(const Membership& now, const std::vector<int>& replicas) {
  std::set<int> joined;
  for (const int r : replicas) {
    if (r < 0 || r >= now.original_replicas) {
      throw std::invalid_argument("elastic: replica " + std::to_string(r) + " was never one of the run's " +
                                  std::to_string(now.original_replicas));
    }
    if (now.member_index(r) >= 0) {
      throw std::invalid_argument("elastic: replica " + std::to_string(r) + " is a member of generation " +
                                  std::to_string(now.generation) + " already");
    }
    joined.insert(r);
  }
  MembershipChange change;
  change.next = now;
  change.next.generation = now.generation + 1;
  change.next.replicas.insert(change.next.replicas.end(), joined.begin(), joined.end());
  std::sort(change.next.replicas.begin(), change.next.replicas.end());
  change.joined.assign(joined.begin(), joined.end());
  change.rank_in_next = ranks_in(now, change.next);
  return change;
}

std::vector<int> complete_replicas(const Membership& now, const std::vector<int>& asked) {
  const Layout original = now.original_layout();
  std::map<int, std::set<int>> asked_of;  // dropped replica -> its ranks asked for
  for (const int rank : asked) {
    if (rank < 0 || rank >= original.world_size()) {
      throw std::invalid_argument("elastic: a replacement asked for rank " + std::to_string(rank) +
                                  ", outside the run's world of " + std::to_string(original.world_size()));
    }
    const int replica = original.coordinates_of(rank).data;
    if (now.member_index(replica) < 0) asked_of[replica].insert(rank);
  }
  std::vector<int> out;
  for (const auto& [replica, ranks] : asked_of) {
    if (static_cast<int>(ranks.size()) == ranks_per_replica(now.sizes)) out.push_back(replica);
  }
  return out;
}

std::vector<std::vector<RowSlice>> rows_per_member(const Membership& m, const std::vector<int64_t>& rows) {
  if (static_cast<int>(rows.size()) != m.original_replicas) {
    throw std::invalid_argument("elastic: rows of " + std::to_string(rows.size()) + " replicas given, the run has " +
                                std::to_string(m.original_replicas));
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r] < 0) throw std::invalid_argument("elastic: replica " + std::to_string(r) + " has a negative row count");
  }
  std::vector<std::vector<RowSlice>> out(m.replicas.size());
  std::vector<int> dropped;
  int64_t orphaned = 0;  // the dropped replicas' rows, end to end in order of replica
  for (int r = 0; r < m.original_replicas; ++r) {
    if (m.member_index(r) >= 0) continue;
    dropped.push_back(r);
    orphaned += rows[r];
  }
  const int64_t n = static_cast<int64_t>(m.replicas.size());
  int64_t start = 0;  // of member j's share, in the orphaned rows
  for (int64_t j = 0; j < n; ++j) {
    const int own = m.replicas[j];
    if (rows[own] > 0) out[j].push_back({own, 0, rows[own]});
    const int64_t share = orphaned / n + (j < orphaned % n ? 1 : 0);
    // [start, start + share) over the dropped replicas' batches laid end to end.
    int64_t offset = 0;
    for (const int r : dropped) {
      const int64_t begin = std::max(start, offset), end = std::min(start + share, offset + rows[r]);
      if (begin < end) out[j].push_back({r, begin - offset, end - offset});
      offset += rows[r];
    }
    start += share;
  }
  return out;
}

}  // namespace harness::parallel
