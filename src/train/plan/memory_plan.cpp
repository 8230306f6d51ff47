// The per-rank memory plan (see memory_plan.h): parameter counts from GPT-2's shapes, the ZeRO
// stages' shares, the activation estimate walked along each pipeline device's schedule, the memory
// this machine has for each rank, and the refusal.
#include "harness/train/plan/memory_plan.h"

#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "harness/host_memory.h"
#include "harness/model/tensor_parallel.h"
#include "harness/pipeline/balance.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/train/step/pipeline_forward_backward.h"
#include "harness/zero/zero.h"

#ifdef HARNESS_WITH_NCCL
#include <cuda_runtime_api.h>
#endif

namespace harness::train {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Parameters of one rank's share of each piece, T tensor-parallel ranks splitting c_attn and c_fc
// by columns (weights and biases) and the two c_proj by rows (weights; their biases replicated).
// The tied wte (and head) rows on the rank holding the most of them: the vocabulary is split over
// the tensor-parallel group as evenly as it goes (model::vocabulary_range).
int64_t vocabulary_rows(const model::GPT2Config& c, int T) { return model::vocabulary_range(c.vocab_size, 0, T).size(); }
int64_t embedding_parameters(const model::GPT2Config& c, int T) {
  return (vocabulary_rows(c, T) + c.n_positions) * c.n_embd;
}
int64_t attention_parameters(const model::GPT2Config& c, int T) {
  const int64_t C = c.n_embd;
  return 2 * C + (3 * C * C + 3 * C) / T + C * C / T + C;  // ln_1, c_attn, c_proj
}
int64_t mlp_parameters(const model::GPT2Config& c, int T) {
  const int64_t C = c.n_embd, I = c.inner_dim();
  return 2 * C + (C * I + I) / T + I * C / T + C;  // ln_2, c_fc, c_proj
}
int64_t unit_parameters(const model::GPT2Config& c, int T, int64_t unit) {
  return unit % 2 == 0 ? attention_parameters(c, T) : mlp_parameters(c, T);
}

// Activation bytes per token of the pieces (the header's table), for one rank.
struct ActivationCosts {
  int64_t attention = 0, mlp = 0, embeddings = 0, head = 0;
  int64_t stage_input = 0;  // what a checkpointed stage keeps
};

ActivationCosts activation_costs(const MemoryPlanInput& in) {
  const model::GPT2Config& c = in.config;
  const int64_t C = c.n_embd, I = c.inner_dim(), V = c.vocab_size, T = in.plan.tensor_parallel_size;
  const int64_t b = in.bf16 ? 2 : 4;
  const int64_t heads = c.n_head / T;
  // Sequence parallelism: what lies between the split layers, 1/T of it on each rank.
  const int64_t S = in.plan.sequence_parallel ? T : 1;
  const int64_t residual_mask = c.resid_pdrop > 0.0 ? C / S : 0;
  ActivationCosts a;
  a.attention = 4 * C / S + b * C + b * 3 * C / T + b * C / T + residual_mask +
                (c.attn_pdrop > 0.0 ? (2 * b + 1) * heads * in.tokens : 4 * heads);
  a.mlp = 4 * C / S + b * C + 2 * b * I / T + residual_mask;
  a.embeddings = (4 * C + (c.embd_pdrop > 0.0 ? C : 0)) / S;
  a.head = 4 * C / S + b * C + 8 * model::vocabulary_range(V, 0, static_cast<int>(T)).size();
  a.stage_input = 4 * C / S;  // with sequence parallelism the stages pass 1/T of it
  return a;
}

// "0-5" / "3": a run of unit indices [first, end).
std::string run_text(int64_t first, int64_t end) {
  return end - first == 1 ? std::to_string(first) : std::to_string(first) + "-" + std::to_string(end - 1);
}

// "0-3" / "0,2" / "0-1,4-5": sorted numbers as runs.
std::string numbers_text(const std::vector<int>& numbers) {
  std::string text;
  for (size_t i = 0; i < numbers.size();) {
    size_t j = i;
    while (j + 1 < numbers.size() && numbers[j + 1] == numbers[j] + 1) ++j;
    if (!text.empty()) text += ",";
    text += run_text(numbers[i], numbers[j] + 1);
    i = j + 1;
  }
  return text;
}

// Half blocks per stage: the input's, or default_balance's blocks, checked against the model.
std::vector<int> stage_halves(const MemoryPlanInput& in, int S) {
  const int n_layer = static_cast<int>(in.config.n_layer);
  const std::string stages_from =
      std::to_string(in.pipeline_devices) + " devices x " + std::to_string(in.virtual_stages) + " virtual stages";
  if (!in.balance_halves.empty()) {
    pipeline::check_halves(in.balance_halves, n_layer, S, stages_from);
    return in.balance_halves;
  }
  std::vector<int> halves;
  try {
    for (int blocks : pipeline::default_balance(n_layer, S)) halves.push_back(2 * blocks);
  } catch (const std::invalid_argument&) {
    // Fewer blocks than stages: what --balance auto may still place by half blocks.
    halves = pipeline::even_balance(2 * n_layer, S);
  }
  return halves;
}

pipeline::TrainingSchedule schedule_of(const MemoryPlanInput& in, const std::vector<int>& halves, int64_t micro_rows) {
  // The order the step runs (zbv's depends on its stages' estimated costs).
  return gpt2_training_schedule(in.schedule, in.micro_batches, in.pipeline_devices, in.virtual_stages, in.config,
                                halves, micro_rows, in.tokens);
}

// The most activation bytes device d holds along its schedule (the header's walk).
int64_t peak_activation_bytes(const pipeline::TrainingSchedule& schedule, const std::vector<std::vector<bool>>& checkpointed,
                              int d, const std::vector<int64_t>& full, const std::vector<int64_t>& input) {
  int64_t held = 0, peak = 0;
  std::map<std::pair<int, int>, std::pair<int64_t, bool>> kept;  // (micro-batch, stage) -> bytes, checkpointed
  const std::vector<pipeline::Action>& actions = schedule.per_device[static_cast<size_t>(d)];
  for (size_t k = 0; k < actions.size(); ++k) {
    const pipeline::Action& a = actions[k];
    const auto key = std::make_pair(a.micro_batch, a.stage);
    if (a.kind == pipeline::Action::Kind::kForward) {
      const bool ck = checkpointed[static_cast<size_t>(d)][k];
      const int64_t bytes = ck ? input[static_cast<size_t>(a.stage)] : full[static_cast<size_t>(a.stage)];
      kept[key] = {bytes, ck};
      held += bytes;
      peak = std::max(peak, held);
    } else if (a.kind == pipeline::Action::Kind::kBackward) {
      auto& [bytes, ck] = kept.at(key);
      const int64_t whole = full[static_cast<size_t>(a.stage)];
      if (ck) peak = std::max(peak, held + whole);
      if (schedule.split_backward) {  // until the W, the layers' inputs stay: counted whole
        held += whole - bytes;
        bytes = whole;
        continue;
      }
      held -= bytes;
      kept.erase(key);
    } else {  // a W pass lets the rest go
      held -= kept.at(key).first;
      kept.erase(key);
    }
  }
  return peak;
}

// largest_unit < 0: ZeRO-3 inside pipeline stages, every unit of the rank's stages gathered for
// the whole step (its weights, and its gradients until its last micro-batch's backward), beside
// the chunks.
void apply_zero(RankMemory& r, const MemoryPlanInput& in, int64_t largest_unit) {
  const int64_t psi = r.parameters, D = in.plan.gradient_group_size();
  const int64_t shard = ceil_div(psi, D);
  r.weight_bytes = 4 * psi;
  r.gradient_bytes = 4 * psi;
  r.optimizer_bytes = 8 * psi;
  if (in.plan.zero.stage >= 1) r.optimizer_bytes = 8 * shard;
  if (in.plan.zero.stage == 2) {
    const int64_t bucket = static_cast<int64_t>(in.plan.gradient_sync.bucket_cap_mb * 1024.0 * 1024.0);
    r.gradient_bytes = std::min(4 * psi, 4 * shard + bucket);
  }
  if (in.plan.zero.stage >= 3 && largest_unit < 0) {
    r.weight_bytes = 4 * shard + 4 * psi;
    r.gradient_bytes = 4 * shard + 4 * psi;
  } else if (in.plan.zero.stage >= 3) {
    const int64_t in_flight = std::min(psi, (in.plan.zero.prefetch + 1) * largest_unit);
    r.weight_bytes = std::min(4 * psi, 4 * shard + 4 * in_flight);
    r.gradient_bytes = std::min(4 * psi, 4 * shard + 4 * in_flight);
  }
}

std::string precision_name(const MemoryPlanInput& in) { return in.bf16 ? "bf16" : "fp32"; }

std::string rank_label(const MemoryPlanInput& in, const std::vector<int>& ranks) {
  if (!in.device_names.empty()) {
    std::string text;
    for (int r : ranks) text += (text.empty() ? "" : ",") + in.device_names.at(static_cast<size_t>(r));
    return text;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + numbers_text(ranks);
}

std::string mib_text(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2);
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024.0 * 1024.0) {
    out << b / (1024.0 * 1024.0 * 1024.0) << " GiB";
  } else {
    out << b / (1024.0 * 1024.0) << " MiB";
  }
  return out.str();
}

// The test hook's figure, when set.
bool test_available_memory(AvailableMemory& available) {
  const char* hook = std::getenv("HARNESS_TEST_AVAILABLE_MEMORY_BYTES");
  if (hook == nullptr || *hook == '\0') return false;
  char* end = nullptr;
  const long long bytes = std::strtoll(hook, &end, 10);
  if (end == hook || *end != '\0' || bytes < 0) {
    throw std::invalid_argument(std::string("HARNESS_TEST_AVAILABLE_MEMORY_BYTES='") + hook +
                                "': expected a number of bytes");
  }
  available.bytes_per_rank = bytes;
  available.how = "HARNESS_TEST_AVAILABLE_MEMORY_BYTES, the test hook";
  return true;
}

#ifdef HARNESS_WITH_NCCL
// cudaMemGetInfo on one GPU. The query makes this process's context there (hundreds of MB):
// `release_context` gives it back (cudaDeviceReset), for a launcher whose workers need the memory
// just measured; otherwise the calling thread's current GPU is restored.
int64_t gpu_free_bytes(int ordinal, bool release_context) {
  int previous = 0;
  (void)cudaGetDevice(&previous);
  size_t free = 0, total = 0;
  cudaError_t status = cudaSetDevice(ordinal);
  if (status == cudaSuccess) status = cudaMemGetInfo(&free, &total);
  if (status != cudaSuccess) {
    throw std::runtime_error("cudaMemGetInfo on cuda:" + std::to_string(ordinal) + ": " + cudaGetErrorString(status));
  }
  if (release_context) {
    (void)cudaDeviceReset();
  } else if (previous != ordinal) {
    (void)cudaSetDevice(previous);
  }
  return static_cast<int64_t>(free);
}
#endif

}  // namespace

const RankMemory& MemoryPlan::largest_model_state() const {
  if (kinds.empty()) throw std::logic_error("MemoryPlan: no ranks");
  const RankMemory* largest = &kinds.front();
  for (const RankMemory& r : kinds) {
    if (r.model_state_bytes() > largest->model_state_bytes()) largest = &r;
  }
  return *largest;
}

int64_t gpt2_parameter_count(const model::GPT2Config& config) {
  return embedding_parameters(config, 1) +
         config.n_layer * (attention_parameters(config, 1) + mlp_parameters(config, 1)) + 2 * config.n_embd;
}

namespace {

// Throws std::invalid_argument naming what is out of range (the flag where there is one).
void check_plan_input(const MemoryPlanInput& in) {
  in.config.validate();
  auto at_least_one = [](int64_t value, const std::string& what) {
    if (value < 1) throw std::invalid_argument("memory plan: " + what + " must be at least 1, got " + std::to_string(value));
  };
  at_least_one(in.plan.gradient_group_size(), "the data-parallel size");
  at_least_one(in.plan.tensor_parallel_size, "--tensor_parallel_size");
  at_least_one(in.pipeline_devices, "the pipeline's devices");
  at_least_one(in.virtual_stages, "--virtual_stages");
  at_least_one(in.micro_batches, "--n_chunk");
  at_least_one(in.rows_per_replica, "the rows per data-parallel rank");
  at_least_one(in.tokens, "--model_max_length");
  zero::check_zero_choice(in.plan.zero);
  if (in.plan.tensor_parallel_size > 1) model::validate_tensor_parallel(in.config, in.plan.tensor_parallel_size);
}

// Every rank holds the whole model (its tensor-parallel slices): one kind.
RankMemory whole_model_memory(const MemoryPlanInput& in) {
  const model::GPT2Config& c = in.config;
  const int T = in.plan.tensor_parallel_size;
  const ActivationCosts cost = activation_costs(in);
  const int64_t block = attention_parameters(c, T) + mlp_parameters(c, T);
  RankMemory r;
  for (int rank = 0; rank < in.plan.gradient_group_size() * T; ++rank) r.ranks.push_back(rank);
  r.who = rank_label(in, r.ranks);
  r.holds = T > 1 ? "whole model, 1/" + std::to_string(T) + " of each split layer" +
                        (in.plan.sequence_parallel ? " and of each sequence between them" : "")
                  : "whole model";
  r.parameters = embedding_parameters(c, T) + c.n_layer * block + 2 * c.n_embd;
  apply_zero(r, in, std::max(block, embedding_parameters(c, T)));
  const int64_t per_token = cost.embeddings + c.n_layer * (cost.attention + cost.mlp) + cost.head;
  r.activation_bytes = in.rows_per_replica * in.tokens * per_token;
  return r;
}

// One kind per pipeline device: its stages' parameters and its peak along the schedule.
std::vector<RankMemory> pipeline_memory(const MemoryPlanInput& in) {
  const model::GPT2Config& c = in.config;
  const int T = in.plan.tensor_parallel_size;
  const ActivationCosts cost = activation_costs(in);
  const int group = in.plan.gradient_group_size() * T;  // ranks of one pipeline device (run_data_parallel)
  const int P = in.pipeline_devices, S = P * in.virtual_stages;
  const std::vector<int> halves = stage_halves(in, S);
  std::vector<int64_t> first_unit(1, 0);
  for (int h : halves) first_unit.push_back(first_unit.back() + h);
  const int64_t micro_rows = ceil_div(in.rows_per_replica, std::min<int64_t>(in.micro_batches, in.rows_per_replica));
  std::vector<int64_t> full(static_cast<size_t>(S)), input(static_cast<size_t>(S));
  for (int s = 0; s < S; ++s) {
    int64_t per_token = 0;
    for (int64_t u = first_unit[s]; u < first_unit[s + 1]; ++u) per_token += u % 2 == 0 ? cost.attention : cost.mlp;
    if (s == 0) per_token += cost.embeddings;
    if (s == S - 1) per_token += cost.head;
    full[static_cast<size_t>(s)] = micro_rows * in.tokens * per_token;
    input[static_cast<size_t>(s)] = micro_rows * in.tokens * (s == 0 ? 8 : cost.stage_input);  // ids, or hidden states
  }
  const pipeline::TrainingSchedule schedule = schedule_of(in, halves, micro_rows);
  const std::vector<std::vector<bool>> checkpointed = pipeline::checkpoint_plan(schedule, in.checkpointing);
  const std::vector<double> work =
      pipeline::gpt2_stage_costs(pipeline::estimate_gpt2_costs(c, micro_rows, in.tokens), halves);
  double all_work = 0.0;
  for (double w : work) all_work += w;

  std::vector<RankMemory> kinds;
  for (int d = 0; d < P; ++d) {
    RankMemory r;
    if (in.device_names.empty()) {
      for (int rank = d * group; rank < (d + 1) * group; ++rank) r.ranks.push_back(rank);
    } else {
      r.ranks = {d};
    }
    r.who = rank_label(in, r.ranks);
    std::vector<int> stages;
    std::string units;
    r.work_share = 0.0;
    for (int s = d; s < S; s += P) {
      stages.push_back(s);
      r.work_share += work[static_cast<size_t>(s)] / all_work;
      units += (units.empty() ? "" : ",") + run_text(first_unit[s], first_unit[s + 1]);
      for (int64_t u = first_unit[s]; u < first_unit[s + 1]; ++u) r.parameters += unit_parameters(c, T, u);
    }
    const bool first = d == 0, last = (S - 1) % P == d;
    std::string extras;
    if (first) {
      r.parameters += embedding_parameters(c, T);
      extras += ", wte, wpe";
    }
    if (last) {
      r.parameters += 2 * c.n_embd;
      extras += ", ln_f";
      if (!first) {  // the tied head's own copy of wte
        r.parameters += vocabulary_rows(c, T) * c.n_embd;
        extras += ", wte (tied head)";
      }
    }
    r.holds = std::string(stages.size() == 1 ? "stage " : "stages ") + numbers_text(stages) + ": block halves " +
              units + extras;
    apply_zero(r, in, /*largest_unit=*/-1);
    r.activation_bytes = peak_activation_bytes(schedule, checkpointed, d, full, input);
    kinds.push_back(r);
  }
  return kinds;
}

}  // namespace

MemoryPlan plan_memory(const MemoryPlanInput& in) {
  check_plan_input(in);
  MemoryPlan plan;
  plan.input = in;
  plan.model_parameters = gpt2_parameter_count(in.config);
  if (in.pipeline) {
    plan.kinds = pipeline_memory(in);
  } else {
    plan.kinds.push_back(whole_model_memory(in));
  }
  return plan;
}

void plan_stages(MemoryPlanInput& in, int devices, const PipelineStepOptions& stages, bool balance_by_time) {
  in.pipeline = true;
  in.pipeline_devices = devices;
  in.virtual_stages = stages.virtual_stages;
  in.schedule = stages.schedule;
  in.micro_batches = stages.micro_batches;
  in.checkpointing = stages.checkpointing;
  in.balance_halves = stages.balance_halves;
  if (balance_by_time) in.balance_note = "--balance auto is timed at start; planned with the default split, by estimated cost";
}

AvailableMemory available_memory(const std::vector<Device>& devices, bool release_gpu_context,
                                 const std::string& noun) {
  AvailableMemory available;
  if (test_available_memory(available)) return available;
  const int ranks = std::max<int>(1, static_cast<int>(devices.size()));
  const bool gpus = !devices.empty() && devices.front().is_cuda();
  if (gpus && torch::cuda::is_available()) {
#ifdef HARNESS_WITH_NCCL
    int64_t smallest = -1;
    std::string where;
    std::vector<int> seen;
    for (const Device& d : devices) {
      if (std::find(seen.begin(), seen.end(), d.index) != seen.end()) continue;
      seen.push_back(d.index);
      const int64_t free = gpu_free_bytes(d.index, release_gpu_context);
      if (smallest < 0 || free < smallest) {
        smallest = free;
        where = d.str();
      }
    }
    available.bytes_per_rank = smallest;
    available.how = "free memory of " + where + (seen.size() > 1 ? ", the least of the " + noun + "s' GPUs" : "");
    return available;
#endif
  }
  const int64_t host = host_available_memory_bytes();
  if (host < 0) {
    available.bytes_per_rank = -1;
    available.how = "unknown: /proc/meminfo has no MemAvailable";
    return available;
  }
  available.bytes_per_rank = host / ranks;
  available.how = "MemAvailable " + std::to_string(host) + " bytes / " + std::to_string(ranks) + " " + noun +
                  (ranks == 1 ? "" : "s") + " on this host";
  return available;
}

std::string bytes_text(int64_t bytes) { return std::to_string(bytes) + " bytes (" + mib_text(bytes) + ")"; }

namespace {

// The plan's header: the model, the layout (or the devices), the batch and the schedule.
void write_plan_header(std::ostream& out, const MemoryPlan& plan) {
  const MemoryPlanInput& in = plan.input;
  const model::GPT2Config& c = in.config;
  out << "memory plan of " << in.program << ": " << in.model_name << " (" << c.n_layer << " layers, n_embd "
      << c.n_embd << ", n_head " << c.n_head << ", vocab " << c.vocab_size << ", " << plan.model_parameters
      << " parameters)\n";
  out << "layout: ";
  if (in.device_names.empty()) {
    if (in.plan.context_parallel_size > 1) {
      out << "data " << in.plan.gradient_group_size() / in.plan.context_parallel_size << " x context " << in.plan.context_parallel_size
          << " x tensor " << in.plan.tensor_parallel_size << " x pipeline ";
    } else {
      out << "data " << in.plan.gradient_group_size() << " x tensor " << in.plan.tensor_parallel_size << " x pipeline ";
    }
    out << (in.pipeline ? in.pipeline_devices : 1) << " = world "
        << in.plan.gradient_group_size() * in.plan.tensor_parallel_size * (in.pipeline ? in.pipeline_devices : 1)
        << ", --zero_stage " << in.plan.zero.stage;
    if (in.plan.zero.stage == 2) out << " (bucket " << in.plan.gradient_sync.bucket_cap_mb << " MB)";
    if (in.plan.zero.stage == 3) out << " (--zero_prefetch " << in.plan.zero.prefetch << ")";
  } else {
    out << (in.pipeline ? std::to_string(in.pipeline_devices) + " devices" : std::string("one device"));
  }
  out << ", --precision " << precision_name(in) << ", " << in.rows_per_replica << " rows x " << in.tokens
      << " tokens per " << (in.device_names.empty() ? "data-parallel rank" : "batch");
  if (in.pipeline) {
    out << ", schedule " << pipeline::to_string(in.schedule) << ", n_chunk " << in.micro_batches << ", virtual_stages "
        << in.virtual_stages << ", activation_checkpointing " << pipeline::to_string(in.checkpointing);
  }
  out << "\n";
  if (!in.balance_note.empty()) out << "note: " << in.balance_note << "\n";

}

// Each kind of rank's bytes, one row each, and with stages each device's share of the work.
void write_plan_table(std::ostream& out, const MemoryPlan& plan) {
  const MemoryPlanInput& in = plan.input;
  const std::vector<std::string> header = {in.device_names.empty() ? "ranks" : "device", "parameters", "weights",
                                           "gradients", "optimizer", "activations~", "total", "holds"};
  std::vector<std::vector<std::string>> rows;
  for (const RankMemory& r : plan.kinds) {
    rows.push_back({in.device_names.empty() ? numbers_text(r.ranks) : r.who, std::to_string(r.parameters), std::to_string(r.weight_bytes), std::to_string(r.gradient_bytes),
                    std::to_string(r.optimizer_bytes), std::to_string(r.activation_bytes),
                    std::to_string(r.total_bytes()), r.holds});
  }
  std::vector<size_t> width(header.size());
  for (size_t i = 0; i < header.size(); ++i) {
    width[i] = header[i].size();
    for (const auto& row : rows) width[i] = std::max(width[i], row[i].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    out << "  ";
    for (size_t i = 0; i < cells.size(); ++i) {
      if (i + 1 == cells.size()) {
        out << cells[i];
      } else if (i == 0) {
        out << std::left << std::setw(static_cast<int>(width[i])) << cells[i] << "  ";
      } else {
        out << std::right << std::setw(static_cast<int>(width[i])) << cells[i] << "  ";
      }
    }
    out << std::left << "\n";
  };
  const std::string unit = in.device_names.empty() ? "rank" : "device";
  out << "bytes per " << unit << " (weights, gradients and AdamW state in fp32; activations~ estimated from the shapes, "
         "not measured):\n";
  line(header);
  for (const auto& row : rows) line(row);
  if (in.pipeline) {
    out << "share of a micro-batch's forward and backward work (GPT-2's pieces costed from their shapes):";
    const char* separator = " ";
    for (const RankMemory& r : plan.kinds) {
      out << separator << (in.device_names.empty() ? numbers_text(r.ranks) : r.who) << " " << std::fixed
          << std::setprecision(1) << 100.0 * r.work_share << "%" << std::defaultfloat;
      separator = ", ";
    }
    out << "\n";
  }
}

// What a rank may use against the most model state a rank holds.
void write_plan_fit(std::ostream& out, const MemoryPlan& plan, const AvailableMemory& available) {
  const std::string unit = plan.input.device_names.empty() ? "rank" : "device";
  const RankMemory& largest = plan.largest_model_state();
  out << "available per " << unit << ": "
      << (available.bytes_per_rank < 0 ? std::string("unknown") : bytes_text(available.bytes_per_rank)) << " ("
      << available.how << ")\n";
  out << "model state per " << unit << ": at most " << bytes_text(largest.model_state_bytes()) << " (" << largest.who << "): ";
  if (available.bytes_per_rank < 0) {
    out << "not checked\n";
  } else if (largest.model_state_bytes() <= available.bytes_per_rank) {
    out << "fits\n";
  } else {
    out << "does NOT fit; the run would be refused\n";
  }
}

}  // namespace

std::string format_memory_plan(const MemoryPlan& plan, const AvailableMemory& available) {
  std::ostringstream out;
  write_plan_header(out, plan);
  write_plan_table(out, plan);
  write_plan_fit(out, plan, available);
  return out.str();
}

std::string memory_plan_line(const MemoryPlan& plan, const AvailableMemory& available) {
  const RankMemory& r = plan.largest_model_state();
  std::ostringstream out;
  const std::string unit = plan.input.device_names.empty() ? "rank" : "device";
  out << "memory plan per " << unit << " (the most: " << r.who << "): weights " << r.weight_bytes << " + gradients "
      << r.gradient_bytes << " + optimizer " << r.optimizer_bytes << " = model state " << r.model_state_bytes()
      << " bytes, activations ~" << r.activation_bytes << " bytes (estimate), total " << bytes_text(r.total_bytes())
      << "; available per " << unit << " "
      << (available.bytes_per_rank < 0 ? std::string("unknown") : bytes_text(available.bytes_per_rank)) << " ("
      << available.how << ")";
  return out.str();
}

void check_model_state_fits(const MemoryPlan& plan, const AvailableMemory& available,
                            const std::function<std::string(int)>& stage_unavailable) {
  if (available.bytes_per_rank < 0) return;  // nothing measured: nothing to refuse on
  const RankMemory& largest = plan.largest_model_state();
  if (largest.model_state_bytes() <= available.bytes_per_rank) return;
  const MemoryPlanInput& in = plan.input;
  const std::string unit = in.device_names.empty() ? "rank" : "device";
  std::ostringstream message;
  message << "the model state needs " << bytes_text(largest.model_state_bytes()) << " per " << unit << " on " << largest.who
          << " (weights " << largest.weight_bytes << " + gradients " << largest.gradient_bytes << " + AdamW "
          << largest.optimizer_bytes << " bytes at --zero_stage " << in.plan.zero.stage << ", " << largest.parameters
          << " parameters held) but " << bytes_text(available.bytes_per_rank) << " are available per " << unit << " ("
          << available.how << ")";
  int fitting = -1;
  int64_t fitting_bytes = 0;
  for (int stage = in.plan.zero.stage + 1; stage <= 3 && fitting < 0; ++stage) {
    MemoryPlanInput other = in;
    other.plan.zero.stage = stage;
    const int64_t bytes = plan_memory(other).largest_model_state().model_state_bytes();
    if (bytes <= available.bytes_per_rank) {
      fitting = stage;
      fitting_bytes = bytes;
    }
  }
  if (fitting >= 0) {
    message << "; --zero_stage " << fitting << " would need " << fitting_bytes << " bytes per " << unit << " and fit";
    const std::string why_not = stage_unavailable(fitting);
    if (!why_not.empty()) message << ", but this build cannot run it here: " << why_not;
  } else {
    MemoryPlanInput other = in;
    other.plan.zero.stage = 3;
    message << "; no ZeRO stage fits: --zero_stage 3 would still need "
            << plan_memory(other).largest_model_state().model_state_bytes() << " bytes per " << unit << " over "
            << in.plan.gradient_group_size() << " data-parallel rank" << (in.plan.gradient_group_size() == 1 ? "" : "s")
            << (in.device_names.empty() ? "; use more ranks (data, tensor or pipeline parallel) or a smaller model"
                                        : "; use more devices (--devices) or a smaller model");
  }
  throw std::invalid_argument(message.str());
}

std::vector<Device> data_parallel_devices(DeviceChoice choice, int ranks_on_host) {
  const bool gpus = uses_gpus(choice);
  std::vector<Device> devices;
  for (int r = 0; r < ranks_on_host; ++r) devices.push_back(gpus ? Device::cuda(r) : Device::cpu(r));
  return devices;
}

}  // namespace harness::train
