// GPT-2 in a pipeline: its blocks as a pipelined Sequential, and its balance by estimated or
// measured cost.
#include "harness/pipeline/gpt2_pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <numeric>
#include <optional>
#include <tuple>
#include <stdexcept>

#include "harness/pipeline/balance.h"
#include "harness/pipeline/with_device.h"

namespace harness::pipeline {

std::shared_ptr<Pipe> enable_pipeline(model::GPT2LMHeadModel& model, const std::vector<Device>& devices,
                                      int64_t split_size, const PipeOptions& options) {
  if (model.is_empty()) throw std::invalid_argument("enable_pipeline: the model holder is empty");
  model->parallelize(devices);
  const auto& block_devices = model->block_devices();
  auto& blocks = model->transformer->h;
  if (blocks->size() != block_devices.size()) {
    throw std::logic_error("enable_pipeline: the model has " + std::to_string(blocks->size()) +
                           " blocks but parallelize placed " + std::to_string(block_devices.size()));
  }
  torch::nn::Sequential sequential;
  for (size_t i = 0; i < blocks->size(); ++i) {
    sequential->push_back(
        "h_" + std::to_string(i),
        WithDevice(model::GPT2Block(blocks->ptr<model::GPT2BlockImpl>(i)), block_devices[i]));
  }
  auto pipe = std::make_shared<Pipe>(sequential, split_size, options);
  std::weak_ptr<Pipe> weak = pipe;
  model->set_blocks_executor([weak](const torch::Tensor& hidden) {
    std::shared_ptr<Pipe> alive = weak.lock();
    if (!alive) {
      throw std::runtime_error(
          "GPT-2 blocks executor: the Pipe from enable_pipeline was destroyed; keep the returned "
          "pointer alive while the model runs, or call disable_pipeline(model)");
    }
    return alive->forward(hidden);
  });
  return pipe;
}

void disable_pipeline(model::GPT2LMHeadModel& model) { model->set_blocks_executor({}); }

namespace {

// The estimate's terms (the header's formulas) for micro-batches of `rows` x `tokens`: products in
// FLOPs of one forward per token, elements of memory-bound work per token not yet weighted by
// kGpt2ElementCost. Throws std::invalid_argument naming `function` on an empty micro-batch.
struct Gpt2Terms {
  double tokens = 0.0;  // N, in a micro-batch
  double attention_products = 0.0, scores = 0.0, mlp_products = 0.0, head_products = 0.0;
  double attention_elements = 0.0, mlp_elements = 0.0, embedding_elements = 0.0;
  double layer_norm = 0.0, softmax = 0.0;  // the head's
  double wte_gradient = 0.0;               // weighted, once per micro-batch
};

Gpt2Terms gpt2_terms(const char* function, const model::GPT2Config& config, int64_t rows, int64_t tokens) {
  if (rows < 1 || tokens < 1) {
    throw std::invalid_argument(std::string(function) + ": micro-batches of " + std::to_string(rows) + " x " +
                                std::to_string(tokens) + " tokens; need at least one of each");
  }
  const double C = static_cast<double>(config.n_embd), I = static_cast<double>(config.inner_dim());
  const double V = static_cast<double>(config.vocab_size);
  const double L = static_cast<double>(std::min<int64_t>(tokens, config.n_positions));
  // Elements of memory-bound work per token, forward and backward: a LayerNorm 6C (read, write;
  // its backward twice that), a dropout 4C, a residual add 3C; attention's q/k/v split and merge
  // 12C; GELU 5I; the loss's softmax 6V.
  const double layer_norm = 6 * C, dropout = 4 * C, residual = 3 * C;
  Gpt2Terms t;
  t.tokens = static_cast<double>(rows) * L;
  t.attention_products = 8 * C * C;  // c_attn, c_proj
  t.scores = 2 * C * (L + 1);        // causal scores and their weighted sum
  t.mlp_products = 4 * C * I;
  t.head_products = 2 * C * V;
  t.attention_elements = layer_norm + 12 * C + dropout + residual;
  t.mlp_elements = layer_norm + 5 * I + dropout + residual;
  t.embedding_elements = 2 * C + dropout;  // the lookups and their dropout
  t.layer_norm = layer_norm;
  t.softmax = 6 * V;
  // wte's V x C gradient, on the first stage a dense one zeroed and filled by the lookups' backward,
  // on the last the head's product: each added into the stage's .grad once per micro-batch.
  t.wte_gradient = kGpt2ElementCost * 3 * V * C;
  return t;
}

}  // namespace

Gpt2PieceCosts estimate_gpt2_costs(const model::GPT2Config& config, int64_t rows, int64_t tokens) {
  const Gpt2Terms t = gpt2_terms("estimate_gpt2_costs", config, rows, tokens);
  const double N = t.tokens, e = kGpt2ElementCost;
  // The backward counted as twice the forward's matmuls.
  Gpt2PieceCosts costs;
  costs.attention = N * (3 * (t.attention_products + t.scores) + e * t.attention_elements);
  costs.mlp = N * (3 * t.mlp_products + e * t.mlp_elements);
  costs.head = N * (3 * t.head_products + e * (t.layer_norm + t.softmax)) + t.wte_gradient;
  costs.embedding = N * e * t.embedding_elements + t.wte_gradient;
  return costs;
}

std::vector<ActionTicks> estimate_gpt2_stage_ticks(const model::GPT2Config& config, const std::vector<int>& halves,
                                                   int64_t rows, int64_t tokens) {
  const Gpt2Terms t = gpt2_terms("estimate_gpt2_stage_ticks", config, rows, tokens);
  for (size_t s = 0; s < halves.size(); ++s) {
    if (halves[s] < 1) {
      throw std::invalid_argument("estimate_gpt2_stage_ticks: stage " + std::to_string(s) + " has " +
                                  std::to_string(halves[s]) + " half blocks; every stage needs one at least");
    }
  }
  if (halves.empty()) return {};
  // The same terms, each given to the action that does it; every piece's three add up to its
  // estimate_gpt2_costs.
  const double N = t.tokens, e = kGpt2ElementCost;
  const double attention_elements = e * t.attention_elements, mlp_elements = e * t.mlp_elements;
  const double embedding_elements = N * e * t.embedding_elements;
  const Gpt2PieceCosts forward{embedding_elements / 3, N * (t.attention_products + t.scores + attention_elements / 3),
                               N * (t.mlp_products + mlp_elements / 3),
                               N * (t.head_products + e * (t.layer_norm / 3 + t.softmax / 2))};
  const Gpt2PieceCosts input_gradient{
      2 * embedding_elements / 3 + t.wte_gradient, N * (t.attention_products + 2 * t.scores + 2 * attention_elements / 3),
      N * (t.mlp_products + 2 * mlp_elements / 3), N * (t.head_products + e * (2 * t.layer_norm / 3 + t.softmax / 2))};
  const Gpt2PieceCosts weight_gradient{0.0, N * t.attention_products, N * t.mlp_products,
                                       N * t.head_products + t.wte_gradient};
  const std::vector<double> f = gpt2_stage_costs(forward, halves), b = gpt2_stage_costs(input_gradient, halves),
                            w = gpt2_stage_costs(weight_gradient, halves);
  double largest = 0.0;
  for (const std::vector<double>* costs : {&f, &b, &w}) {
    largest = std::max(largest, *std::max_element(costs->begin(), costs->end()));
  }
  auto ticks = [&](double cost) { return std::max(1, static_cast<int>(std::lround(1000.0 * cost / largest))); };
  std::vector<ActionTicks> out;
  for (size_t s = 0; s < halves.size(); ++s) out.push_back({ticks(f[s]), ticks(b[s]), ticks(w[s])});
  return out;
}

namespace {

// Each block half's cost in model order: unit 2b is block b's attention half, 2b + 1 its MLP half.
std::vector<double> unit_costs(const Gpt2PieceCosts& costs, int64_t units) {
  std::vector<double> out;
  for (int64_t u = 0; u < units; ++u) out.push_back(u % 2 == 0 ? costs.attention : costs.mlp);
  return out;
}

}  // namespace

std::vector<int> balance_gpt2(const Gpt2PieceCosts& costs, int64_t n_layer, int stages) {
  return balance_by_cost(unit_costs(costs, 2 * n_layer), stages, costs.embedding, costs.head);
}

std::vector<double> gpt2_stage_costs(const Gpt2PieceCosts& costs, const std::vector<int>& halves) {
  int64_t units = 0;
  for (int h : halves) units += h;
  const std::vector<double> unit = unit_costs(costs, units);
  std::vector<double> out;
  auto first = unit.begin();
  for (int h : halves) {
    out.push_back(std::accumulate(first, first + h, 0.0));
    first += h;
  }
  if (!out.empty()) {
    out.front() += costs.embedding;
    out.back() += costs.head;
  }
  return out;
}

std::vector<int> balance_gpt2_by_cost(const model::GPT2Config& config, int stages, int64_t rows, int64_t tokens) {
  return balance_gpt2(estimate_gpt2_costs(config, rows, tokens), config.n_layer, stages);
}

namespace {

// C(n, k), or `cap` + 1 once it passes `cap`.
int64_t choose_capped(int64_t n, int64_t k, int64_t cap) {
  if (k < 0 || k > n) return 0;
  k = std::min(k, n - k);
  int64_t out = 1;
  for (int64_t i = 1; i <= k; ++i) {
    out = out * (n - k + i) / i;  // exact: a product of i consecutive integers is divisible by i!
    if (out > cap) return cap + 1;
  }
  return out;
}

// The split of `units` (block halves in model order, the embedding added to the first stage and the
// head to the last) into 2 D stages whose devices are most even (device d: stages d and 2D - 1 - d),
// by their loads sorted from the largest, then the stages' costs sorted likewise, then the split
// itself, each lexicographically smallest. Empty where the search would pass kZbvSplitsSearched.
std::vector<int> even_zbv_devices(const std::vector<double>& units, double embedding, double head, int devices) {
  const int n = static_cast<int>(units.size()), stages = 2 * devices;
  if (stages > n || choose_capped(n - 1, stages - 1, kZbvSplitsSearched) > kZbvSplitsSearched) return {};
  std::vector<double> prefix(n + 1, 0.0);
  for (int u = 0; u < n; ++u) prefix[u + 1] = prefix[u] + units[u];
  std::vector<int> cut(stages + 1);  // stage s runs units [cut[s], cut[s + 1])
  for (int s = 0; s < stages; ++s) cut[s] = s;
  cut[stages] = n;
  struct Key {
    std::vector<double> loads, costs;
    std::vector<int> halves;
  };
  std::optional<Key> best;
  Key key;  // each split's, its buffers reused
  for (;;) {
    key.loads.clear();
    key.costs.clear();
    key.halves.clear();
    for (int s = 0; s < stages; ++s) {
      key.costs.push_back(prefix[cut[s + 1]] - prefix[cut[s]] + (s == 0 ? embedding : 0.0) +
                          (s == stages - 1 ? head : 0.0));
      key.halves.push_back(cut[s + 1] - cut[s]);
    }
    for (int d = 0; d < devices; ++d) key.loads.push_back(key.costs[d] + key.costs[stages - 1 - d]);
    std::sort(key.loads.begin(), key.loads.end(), std::greater<double>());
    std::sort(key.costs.begin(), key.costs.end(), std::greater<double>());
    if (!best || std::tie(key.loads, key.costs, key.halves) < std::tie(best->loads, best->costs, best->halves)) {
      best = key;
    }
    // The next cuts 1..stages-1 in lexicographic order (each below the next, the last below n).
    int s = stages - 1;
    while (s >= 1 && cut[s] == n - (stages - s)) --s;
    if (s < 1) break;
    ++cut[s];
    for (int t = s + 1; t < stages; ++t) cut[t] = cut[t - 1] + 1;
  }
  return best->halves;
}

// How much of its step zbv's order on `halves` idles, on their estimated ticks.
double zbv_bubble(const model::GPT2Config& config, const std::vector<int>& halves, int devices, int micro_batches,
                  int64_t rows, int64_t tokens) {
  const std::vector<ActionTicks> ticks = estimate_gpt2_stage_ticks(config, halves, rows, tokens);
  return simulate(zbv_schedule(micro_batches, devices, ticks), ticks).bubble;
}

}  // namespace

std::vector<int> balance_gpt2_for_zbv(const model::GPT2Config& config, int devices, int micro_batches, int64_t rows,
                                      int64_t tokens) {
  const Gpt2PieceCosts costs = estimate_gpt2_costs(config, rows, tokens);
  const std::vector<int> stages_even = balance_gpt2(costs, config.n_layer, 2 * devices);  // balance_gpt2_by_cost's
  const std::vector<int> devices_even =
      even_zbv_devices(unit_costs(costs, 2 * config.n_layer), costs.embedding, costs.head, devices);
  if (devices_even.empty() || devices_even == stages_even) return stages_even;
  // The same work either way: the order that idles less takes the shorter step.
  return zbv_bubble(config, devices_even, devices, micro_batches, rows, tokens) <
                 zbv_bubble(config, stages_even, devices, micro_batches, rows, tokens)
             ? devices_even
             : stages_even;
}

std::vector<int> balance_gpt2_by_time(model::GPT2LMHeadModel& model, const Device& device, int stages,
                                      int64_t rows, int64_t tokens) {
  return balance_gpt2(time_gpt2_costs(model, device, rows, tokens), model->config().n_layer, stages);
}

Gpt2PieceCosts time_gpt2_costs(model::GPT2LMHeadModel& model, const Device& device, int64_t rows, int64_t tokens) {
  model::GPT2LMHeadModelImpl& gpt2 = *model;
  const model::GPT2Config& config = gpt2.config();
  const c10::Device where = device.torch_device();
  model->to(where);
  const bool was_training = model->is_training();
  model->train(true);
  const int64_t C = config.n_embd;
  tokens = std::min<int64_t>(tokens, config.n_positions);
  const auto floats = torch::TensorOptions().device(where).dtype(torch::kFloat32);
  const at::Tensor ids = torch::randint(config.vocab_size, {rows, tokens},
                                        torch::TensorOptions().device(where).dtype(torch::kLong));
  const at::Tensor weights = torch::ones({rows, tokens}, floats);

  auto seconds_of = [&](const std::function<at::Tensor()>& forward_backward) {
    std::vector<double> times;
    for (int k = 0; k < 4; ++k) {
      const auto start = std::chrono::steady_clock::now();
      (void)forward_backward().sum().item<double>();  // waits for a GPU too
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (k > 0) times.push_back(t);  // the first run warms up
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  auto backward_from = [](const at::Tensor& out) {
    torch::autograd::backward({out}, {torch::ones_like(out)});
  };
  const double embed = seconds_of([&] {
    at::Tensor out = gpt2.embed(ids);
    backward_from(out);
    return gpt2.transformer->wte->weight.grad();
  });
  const double attention = seconds_of([&] {
    at::Tensor x = torch::randn({rows, tokens, C}, floats).requires_grad_(true);
    backward_from(gpt2.forward_units(x, 0, 1));
    return x.grad();
  });
  const double mlp = seconds_of([&] {
    at::Tensor x = torch::randn({rows, tokens, C}, floats).requires_grad_(true);
    backward_from(gpt2.forward_units(x, 1, 2));
    return x.grad();
  });
  const double head = seconds_of([&] {
    at::Tensor x = torch::randn({rows, tokens, C}, floats).requires_grad_(true);
    const at::Tensor head_weight = gpt2.transformer->wte->weight.detach().requires_grad_(true);
    gpt2.head_loss(x, ids, weights, at::Tensor(), head_weight).backward();
    return x.grad();
  });
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  model->train(was_training);
  Gpt2PieceCosts costs;
  costs.embedding = embed;
  costs.attention = attention;
  costs.mlp = mlp;
  costs.head = head;
  return costs;
}

int gpt2_stage_of_parameter(const std::string& name, const std::vector<int64_t>& first_unit_of_stage) {
  const int S = static_cast<int>(first_unit_of_stage.size()) - 1;
  if (S < 1) throw std::invalid_argument("gpt2_stage_of_parameter: no stages given");
  const std::string blocks = "transformer.h.";
  if (name.rfind("transformer.wte.", 0) == 0 || name.rfind("transformer.wpe.", 0) == 0) return 0;
  if (name.rfind("transformer.ln_f.", 0) == 0) return S - 1;
  if (name.rfind(blocks, 0) == 0) {
    const size_t dot = name.find('.', blocks.size());
    const std::string rest = dot == std::string::npos ? "" : name.substr(dot + 1);
    const bool attention = rest.rfind("ln_1.", 0) == 0 || rest.rfind("attn.", 0) == 0;
    const bool mlp = rest.rfind("ln_2.", 0) == 0 || rest.rfind("mlp.", 0) == 0;
    if (attention || mlp) {
      const int64_t unit = 2 * std::stoll(name.substr(blocks.size(), dot - blocks.size())) + (mlp ? 1 : 0);
      for (int s = 0; s < S; ++s) {
        if (first_unit_of_stage[s] <= unit && unit < first_unit_of_stage[s + 1]) return s;
      }
      throw std::invalid_argument("gpt2_stage_of_parameter: " + name + " is in block half " + std::to_string(unit) +
                                  ", outside the stages' " + std::to_string(first_unit_of_stage.back()));
    }
  }
  throw std::invalid_argument("gpt2_stage_of_parameter: " + name + " is not a GPT-2 parameter");
}

bool stage_holds_gpt2_parameter(int stage, const std::string& name, const std::vector<int64_t>& first_unit_of_stage) {
  const int S = static_cast<int>(first_unit_of_stage.size()) - 1;
  return gpt2_stage_of_parameter(name, first_unit_of_stage) == stage ||
         (stage == S - 1 && name == "transformer.wte.weight");
}

}  // namespace harness::pipeline
