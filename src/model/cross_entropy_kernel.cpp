// The loops behind model::weighted_token_cross_entropy on the CPU (see cross_entropy.h). Like
// gelu_kernel.cpp: no torch header, -O3 (CMakeLists.txt), an x86-64-v4, an AVX2 and a plain copy
// of each loop. Sums and maxima run in 16 lanes (GCC keeps a plain sum in order, unvectorized).
#include "cross_entropy_kernel.h"

#include <cmath>
#include <cstdint>

#include "fast_exp.h"

namespace harness::model::detail {
namespace {

constexpr int64_t kLanes = 16;

inline float row_max(const float* __restrict x, int64_t V) {
  float lanes[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = -INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
  }
  float m = -INFINITY;
  for (; j < V; ++j) m = x[j] > m ? x[j] : m;
  for (int64_t l = 0; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  return m;
}

// Accumulated in double: the sum of a row's exponentials is then the same, to float's precision,
// whatever order its parts are added in, so a vocabulary split over ranks (two partial sums
// added) gives the unsplit row's logsumexp.
inline double row_sum_exp(const float* __restrict x, float shift, int64_t V) {
  double lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(exp_nonpositive(x[j + l] - shift));
  }
  double sum = 0.0;
  for (; j < V; ++j) sum += static_cast<double>(exp_nonpositive(x[j] - shift));
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

}  // namespace

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void rows_logsumexp(const float* x, int64_t rows, int64_t V, float* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * V;
    const float m = row_max(row, V);
    // A row of -infinity (or with +infinity or NaN) gives what log-softmax gives: -inf or NaN.
    lse[r] = std::isfinite(m) ? static_cast<float>(static_cast<double>(m) + std::log(row_sum_exp(row, m, V)))
                              : m + (m - m);
  }
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void rows_sum_exp(const float* x, int64_t rows, int64_t V, const float* shift, double* sums) {
  for (int64_t r = 0; r < rows; ++r) sums[r] = row_sum_exp(x + r * V, shift[r], V);
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void rows_cross_entropy_backward(const float* x, const float* lse, const int64_t* labels, const float* scale,
                                 int64_t rows, int64_t V, float* d) {
  for (int64_t r = 0; r < rows; ++r) {
    const float shift = lse[r], s = scale[r];
    if (d == x) {
      // In place: the same arithmetic on one array (each logit read, then written over).
      float* __restrict row = d + r * V;
      for (int64_t j = 0; j < V; ++j) row[j] = s * exp_nonpositive(row[j] - shift);
    } else {
      const float* __restrict row = x + r * V;
      float* __restrict out = d + r * V;
      for (int64_t j = 0; j < V; ++j) out[j] = s * exp_nonpositive(row[j] - shift);
    }
    const int64_t label = labels[r];
    if (label >= 0 && label < V) d[r * V + label] -= s;
  }
}

}  // namespace harness::model::detail
