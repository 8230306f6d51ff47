// GPipe's clock schedule as plain data: which (micro-batch i, partition j) tasks may run together.
// The executor (Pipe) applies it; nothing here knows about tensors or devices.
#pragma once

#include <utility>
#include <vector>

namespace harness::pipeline {

// One clock cycle: the (i, j) pairs that run concurrently, each on partition j's device.
using Cycle = std::vector<std::pair<int, int>>;

// Forward schedule for m micro-batches over n partitions: m + n - 1 cycles, cycle k holding every
// (i, j) with i + j == k, i descending. For m = 3, n = 3:
//
//   partition   k=0     k=1     k=2     k=3     k=4
//      0       (0,0)   (1,0)   (2,0)
//      1               (0,1)   (1,1)   (2,1)
//      2                       (0,2)   (1,2)   (2,2)
//
//   -> [(0,0)], [(1,0),(0,1)], [(2,0),(1,1),(0,2)], [(2,1),(1,2)], [(2,2)]
//
// Throws std::invalid_argument unless m >= 1 and n >= 1.
std::vector<Cycle> clock_cycles(int m, int n);

// Backward schedule: the forward clock run in reverse, so (i, j)'s backward comes after
// (i, j + 1)'s, which produces the gradient it needs. Cycle k holds every (i, j) with
// i + j == m + n - 2 - k, i ascending. For m = 3, n = 3:
//   [(2,2)], [(1,2),(2,1)], [(0,2),(1,1),(2,0)], [(0,1),(1,0)], [(0,0)]
std::vector<Cycle> backward_clock_cycles(int m, int n);

}  // namespace harness::pipeline
