// Row loops of the fused token cross entropy (see cross_entropy.h) on contiguous float arrays.
#pragma once

#include <cstdint>

namespace harness::model::detail {

// lse[r] = log(sum_j exp(x[r, j])) for the rows [0, rows) of x [rows, V]; max-shifted, the sum
// and its log in double, rounded once.
void rows_logsumexp(const float* x, int64_t rows, int64_t V, float* lse);

// sums[r] = sum_j exp(x[r, j] - shift[r]) for the rows [0, rows) of x [rows, V], each shift at
// least its row's maximum (a vocabulary slice's sum against the whole row's maximum), in double
// like rows_logsumexp's, so that the slices' sums add up to the unsplit row's.
void rows_sum_exp(const float* x, int64_t rows, int64_t V, const float* shift, double* sums);

// d[r, j] = scale[r] * (exp(x[r, j] - lse[r]) - (j == label[r])), for the rows [0, rows); a label
// outside [0, V) subtracts nothing. d may be x itself (in place); otherwise the outputs must not
// overlap the inputs.
void rows_cross_entropy_backward(const float* x, const float* lse, const int64_t* labels, const float* scale,
                                 int64_t rows, int64_t V, float* d);

}  // namespace harness::model::detail
