// Shared by the train tests: comparing the weights of two GPT-2 training runs.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

namespace harness::train::testing {

// |a - b| / |b| (|b| at least 1e-12).
inline double relative(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).norm() / b.norm().clamp_min(1e-12)).item<double>();
}

// Every weight of `actual` within `tolerance` (relative) of `expected`'s, except the key third of
// each c_attn.bias: it adds q_i . b_k to every score of query i, which softmax ignores, so its
// gradient is 0 up to rounding (checked against `expected_first_gradients`), and AdamW divides
// that rounding by its own square root: the key bias walks by sign noise in both runs. Its query
// and value thirds are compared as every other weight is.
inline void expect_same_weights(const std::map<std::string, at::Tensor>& actual,
                                const std::map<std::string, at::Tensor>& expected,
                                const std::map<std::string, at::Tensor>& expected_first_gradients,
                                int64_t n_embd, double tolerance, const std::string& label) {
  const int64_t C = n_embd;
  for (const auto& [name, weight] : expected) {
    ASSERT_TRUE(actual.count(name)) << label << ": no weight " << name;
    if (name.find("attn.c_attn.bias") != std::string::npos) {
      const at::Tensor key_grad = expected_first_gradients.at(name).slice(0, C, 2 * C);
      EXPECT_LT(key_grad.abs().max().item<double>(), 1e-7) << label << ": " << name;
      for (int64_t part : {0, 2}) {
        EXPECT_LE(relative(actual.at(name).slice(0, part * C, (part + 1) * C),
                           weight.slice(0, part * C, (part + 1) * C)),
                  tolerance)
            << label << ": weight " << name << " part " << part;
      }
      continue;
    }
    EXPECT_LE(relative(actual.at(name), weight), tolerance) << label << ": weight " << name;
  }
}

}  // namespace harness::train::testing
