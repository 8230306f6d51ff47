// A step's time predicted from a plan (see cost_model.h).
#include "harness/train/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "harness/model/tensor_parallel.h"
#include "harness/pipeline/gpt2_pipeline.h"
#include "harness/pipeline/training_schedule.h"
#include "harness/train/plan/memory_plan.h"
#include "harness/train/step/context_parallel_step.h"
#include "harness/train/step/pipeline_forward_backward.h"

namespace harness::train {
namespace {

using nlohmann::json;

double positive_number(const json& j, const std::string& field, const std::string& origin) {
  if (!j.contains(field)) throw std::invalid_argument(origin + ": field '" + field + "' is missing");
  const json& value = j.at(field);
  if (!value.is_number() || value.get<double>() <= 0.0) {
    throw std::invalid_argument(origin + ": field '" + field + "' must be a number > 0, got " + value.dump());
  }
  return value.get<double>();
}

Link link_from_json(const json& j, const std::string& field, const std::string& origin) {
  if (!j.contains(field) || !j.at(field).is_object()) {
    throw std::invalid_argument(origin + ": field '" + field + "' must be an object");
  }
  const std::string where = origin + ": " + field;
  return {positive_number(j.at(field), "bytes_per_second", where), positive_number(j.at(field), "latency_seconds", where)};
}

// Every figure of a machine file needs its source.
constexpr const char* kFigures[] = {"fp32_flops", "bf16_flops", "matmul_efficiency", "memory_bytes_per_second",
                                    "memory_bytes", "inside_host", "between_hosts"};

}  // namespace

Machine machine_from_json(const json& j, const std::string& origin) {
  if (!j.is_object()) throw std::invalid_argument(origin + ": expected a JSON object");
  Machine m;
  if (!j.contains("name") || !j.at("name").is_string()) {
    throw std::invalid_argument(origin + ": field 'name' must be a string");
  }
  m.name = j.at("name").get<std::string>();
  m.devices_per_host = static_cast<int>(positive_number(j, "devices_per_host", origin));
  m.fp32_flops = positive_number(j, "fp32_flops", origin);
  m.bf16_flops = positive_number(j, "bf16_flops", origin);
  m.matmul_efficiency = positive_number(j, "matmul_efficiency", origin);
  if (m.matmul_efficiency > 1.0) throw std::invalid_argument(origin + ": field 'matmul_efficiency' must be at most 1");
  m.memory_bytes_per_second = positive_number(j, "memory_bytes_per_second", origin);
  m.memory_bytes = static_cast<int64_t>(positive_number(j, "memory_bytes", origin));
  m.inside_host = link_from_json(j, "inside_host", origin);
  m.between_hosts = link_from_json(j, "between_hosts", origin);
  if (!j.contains("sources") || !j.at("sources").is_object()) {
    throw std::invalid_argument(origin + ": field 'sources' must be an object naming where each figure comes from");
  }
  m.sources = j.at("sources");
  for (const char* figure : kFigures) {
    if (!m.sources.contains(figure) || !m.sources.at(figure).is_string() || m.sources.at(figure).get<std::string>().empty()) {
      throw std::invalid_argument(origin + ": field 'sources' gives no source for '" + figure + "'");
    }
  }
  return m;
}

json machine_to_json(const Machine& m) {
  auto link = [](const Link& l) { return json{{"bytes_per_second", l.bytes_per_second}, {"latency_seconds", l.latency_seconds}}; };
  return {{"name", m.name},
          {"devices_per_host", m.devices_per_host},
          {"fp32_flops", m.fp32_flops},
          {"bf16_flops", m.bf16_flops},
          {"matmul_efficiency", m.matmul_efficiency},
          {"memory_bytes_per_second", m.memory_bytes_per_second},
          {"memory_bytes", m.memory_bytes},
          {"inside_host", link(m.inside_host)},
          {"between_hosts", link(m.between_hosts)},
          {"sources", m.sources}};
}

Machine read_machine(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("--machine " + path + ": cannot be read");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(path + ": not JSON: " + e.what());
  }
  return machine_from_json(j, path);
}

double collective_bytes(Collective collective, double payload_bytes, int ranks) {
  if (ranks <= 1) return 0.0;
  const double share = static_cast<double>(ranks - 1) / ranks;
  switch (collective) {
    case Collective::kAllReduce: return 2.0 * share * payload_bytes;
    case Collective::kAllGather:
    case Collective::kReduceScatter: return share * payload_bytes;
    case Collective::kSendRecv: return payload_bytes;
  }
  return 0.0;
}

double collective_seconds(Collective collective, double payload_bytes, int ranks, const Link& link) {
  if (ranks <= 1) return 0.0;
  const int steps = collective == Collective::kAllReduce ? 2 * (ranks - 1)
                    : collective == Collective::kSendRecv ? 1
                                                          : ranks - 1;
  return steps * link.latency_seconds + collective_bytes(collective, payload_bytes, ranks) / link.bytes_per_second;
}

double block_training_flops(const model::GPT2Config& config, double tokens, int64_t sequence_length) {
  const double C = static_cast<double>(config.n_embd), I = static_cast<double>(config.inner_dim());
  const double matmuls = 2.0 * (4.0 * C * C + 2.0 * C * I);  // c_attn 3C^2, c_proj C^2, c_fc and c_proj C x I
  const double attention = 2.0 * C * static_cast<double>(sequence_length);  // QK^T and AV, half under the mask
  return 3.0 * (matmuls + attention) * tokens;
}

double model_training_flops(const model::GPT2Config& config, double tokens, int64_t sequence_length) {
  const double head = 6.0 * static_cast<double>(config.n_embd) * static_cast<double>(config.vocab_size) * tokens;
  return static_cast<double>(config.n_layer) * block_training_flops(config, tokens, sequence_length) + head;
}

namespace {

// The link a kind of group crosses: between hosts where any of its groups spans two hosts of
// `per_host` consecutive ranks (rank order: tensor fastest, then context, data, pipeline).
Link link_of(const std::vector<std::vector<int>>& groups, int per_host, const Machine& machine) {
  for (const std::vector<int>& group : groups) {
    for (const int rank : group) {
      if (rank / per_host != group.front() / per_host) return machine.between_hosts;
    }
  }
  return machine.inside_host;
}

// One layout's shapes and links, worked out once.
struct Shapes {
  int D = 1, C = 1, T = 1, P = 1, M = 1;
  int64_t replica_rows = 0, micro_rows = 0;
  int64_t padded_length = 0, rank_tokens = 0;  // a sequence's positions, and a rank's share of them
  double element_bytes = 4.0;                   // of activations on the wire
  double activation_bytes = 0.0;                // one micro-batch's [rows, rank tokens, n_embd] on the wire
  double rate = 0.0;                            // matmul FLOP/s reached, per device
  Link tensor, context, pipeline, gradient;
  std::vector<int> halves;                      // P > 1: half blocks per stage
};

Shapes shapes_of(const PlanQuestion& q, const Plan& plan) {
  plan.validate();
  const parallel::Layout layout = plan.layout();
  Shapes s;
  s.D = layout.data_parallel_size(), s.C = layout.context_parallel_size(), s.T = layout.tensor_parallel_size();
  s.P = layout.pipeline_parallel_size();
  if (s.T > 1) model::validate_tensor_parallel(q.config, s.T);
  if (q.batch_size % s.D != 0) {
    throw std::invalid_argument("--batch_size " + std::to_string(q.batch_size) + " is not divisible by the " +
                                std::to_string(s.D) + " data-parallel replicas");
  }
  s.replica_rows = q.batch_size / s.D;
  s.M = s.P > 1 ? static_cast<int>(plan.pipeline.n_chunk) : 1;
  if (s.M < 1 || s.M > s.replica_rows) {
    throw std::invalid_argument("--n_chunk " + std::to_string(s.M) + " must be between 1 and the " +
                                std::to_string(s.replica_rows) + " rows of a replica");
  }
  s.micro_rows = (s.replica_rows + s.M - 1) / s.M;
  s.padded_length = split_sequence_length(q.sequence_length, s.C, plan.sequence_parallel ? s.T : 1);
  if (s.padded_length > q.config.n_positions) {
    throw std::invalid_argument("the sequence padded to " + std::to_string(s.padded_length) +
                                " positions is longer than the model's n_positions");
  }
  s.rank_tokens = s.padded_length / s.C;
  s.element_bytes = q.bf16 ? 2.0 : 4.0;
  s.activation_bytes = static_cast<double>(s.micro_rows * s.rank_tokens * q.config.n_embd) * s.element_bytes;
  s.rate = (q.bf16 ? q.machine.bf16_flops : q.machine.fp32_flops) * q.machine.matmul_efficiency;
  const int per_host = q.nproc_per_node > 0 ? q.nproc_per_node : q.machine.devices_per_host;
  s.tensor = link_of(layout.tensor_parallel_groups(), per_host, q.machine);
  s.context = link_of(layout.context_parallel_groups(), per_host, q.machine);
  s.pipeline = link_of(layout.pipeline_groups(), per_host, q.machine);
  s.gradient = link_of(layout.gradient_groups(), per_host, q.machine);
  if (s.P > 1) {
    s.halves = balanced_pipeline_options(plan.pipeline, s.P, /*processes=*/true, q.config, s.replica_rows,
                                         s.padded_length)
                   .balance_halves;
  }
  return s;
}

// Tensor parallelism's collectives in one block's forward (its backward has as many): two
// all-reduces of a micro-batch's activations (sequence parallelism: an all-gather and a
// reduce-scatter for each, the same bytes). Context parallelism's ring in one block's forward
// and backward: a chunk's keys and values passed C - 1 times forward and again backward, and
// their gradients C times; the ring's sends wait on each other and on the attention they feed
// (the executor does not run them behind other work).
struct BlockComm {
  double tensor = 0.0;   // a forward's (the backward's the same)
  double context = 0.0;  // forward and backward
};

BlockComm block_comm(const Plan& plan, const Shapes& s) {
  const double activation = s.activation_bytes;
  BlockComm comm;
  comm.tensor = plan.sequence_parallel
                    ? 2.0 * (collective_seconds(Collective::kAllGather, activation, s.T, s.tensor) +
                             collective_seconds(Collective::kReduceScatter, activation, s.T, s.tensor))
                    : 2.0 * collective_seconds(Collective::kAllReduce, activation, s.T, s.tensor);
  if (s.C > 1) {
    const double keys_and_values = 2.0 * activation / s.T;
    comm.context = (2 * (s.C - 1) + s.C) * collective_seconds(Collective::kSendRecv, keys_and_values, 2, s.context);
  }
  return comm;
}

// What tensor parallelism adds once a micro-batch besides the blocks: the vocabulary-parallel
// embedding's all-reduce forward and the split head's input gradient backward.
double embedding_comm(const Shapes& s) {
  return 2.0 * collective_seconds(Collective::kAllReduce, s.activation_bytes, s.T, s.tensor);
}

// The pieces' costs for one micro-batch on one rank, in seconds (forward and backward): the
// shapes' estimate (pipeline::estimate_gpt2_costs) over the rate, 1/T on each tensor-parallel
// rank, the attention of C > 1 over every position of the sequence.
pipeline::Gpt2PieceCosts piece_seconds(const PlanQuestion& q, const Shapes& s) {
  pipeline::Gpt2PieceCosts c = pipeline::estimate_gpt2_costs(q.config, s.micro_rows, s.rank_tokens);
  c.attention += 3.0 * 2.0 * q.config.n_embd * static_cast<double>(s.padded_length - s.rank_tokens) *
                 static_cast<double>(s.micro_rows * s.rank_tokens);
  const double per_second = s.T * s.rate;
  return {c.embedding / per_second, c.attention / per_second, c.mlp / per_second, c.head / per_second};
}

struct StepTimes {
  double compute = 0.0, comm = 0.0, bubble = 0.0;
};

// P = 1: the replica's one micro-batch, its blocks' collectives exposed.
StepTimes whole_model_times(const PlanQuestion& q, const Plan& plan, const Shapes& s) {
  const pipeline::Gpt2PieceCosts c = piece_seconds(q, s);
  const BlockComm comm = block_comm(plan, s);
  StepTimes t;
  t.compute = c.embedding + q.config.n_layer * (c.attention + c.mlp) + c.head;
  t.comm = q.config.n_layer * (2.0 * comm.tensor + comm.context) + embedding_comm(s);
  return t;
}

// P > 1: each stage's F, B and W in seconds (the shapes' split of its cost, its blocks'
// collectives, its sends, the forward again under activation checkpointing), on the executor's own
// schedule; the busiest device's work, its exposed communication and its idle time.
StepTimes pipeline_times(const PlanQuestion& q, const Plan& plan, const Shapes& s) {
  const pipeline::Gpt2PieceCosts c = piece_seconds(q, s);
  const std::vector<double> stage_seconds = pipeline::gpt2_stage_costs(c, s.halves);
  const std::vector<pipeline::ActionTicks> shares =
      pipeline::estimate_gpt2_stage_ticks(q.config, s.halves, s.micro_rows, s.rank_tokens);
  const BlockComm comm = block_comm(plan, s);
  const double send = collective_seconds(Collective::kSendRecv, s.activation_bytes / s.T, 2, s.pipeline);
  const double embedding = embedding_comm(s) / 2.0;  // half forward, half backward
  const int stages = static_cast<int>(s.halves.size());
  struct Seconds {
    double f = 0, b = 0, w = 0, comm_f = 0, comm_b = 0;
  };
  std::vector<Seconds> per(stages);
  double longest = 0.0;
  for (int k = 0; k < stages; ++k) {
    const double ticks = shares[k].forward + shares[k].input_gradient + shares[k].weight_gradient;
    Seconds& x = per[k];
    x.f = stage_seconds[k] * shares[k].forward / ticks;
    x.b = stage_seconds[k] * shares[k].input_gradient / ticks;
    x.w = stage_seconds[k] * shares[k].weight_gradient / ticks;
    const double blocks = s.halves[k] / 2.0;
    x.comm_f = blocks * (comm.tensor + comm.context / 3.0) + (k + 1 < stages ? send : 0.0) +
               (k == 0 || k + 1 == stages ? embedding : 0.0);
    x.comm_b = blocks * (comm.tensor + 2.0 * comm.context / 3.0) + (k > 0 ? send : 0.0) +
               (k == 0 || k + 1 == stages ? embedding : 0.0);
    const bool recompute = plan.pipeline.activation_checkpointing == pipeline::ActivationCheckpointing::kAlways ||
                           (plan.pipeline.activation_checkpointing == pipeline::ActivationCheckpointing::kExceptLast &&
                            k + 1 < stages);
    if (recompute) {
      x.b += x.f;
      x.comm_b += blocks * comm.tensor;
    }
    longest = std::max({longest, x.f + x.comm_f, x.b + x.comm_b, x.w});
  }
  const pipeline::TrainingSchedule schedule =
      gpt2_training_schedule(plan.pipeline.schedule, s.M, s.P, pipeline::chunks_per_device(plan.pipeline.schedule,
                                                                                           plan.pipeline.virtual_stages),
                             q.config, s.halves, s.micro_rows, s.rank_tokens);
  // A clock of integer ticks: the longest action 200 of them, fewer for long schedules (the clock
  // keeps a slot a tick and device), at least 4.
  const int actions = 3 * s.M * schedule.virtual_stages + 2 * s.P;
  const double resolution = std::clamp(20000.0 / actions, 4.0, 200.0);
  const double tick = longest > 0.0 ? longest / resolution : 1.0;
  auto ticks_of = [tick](double seconds) { return std::max(1, static_cast<int>(std::lround(seconds / tick))); };
  std::vector<pipeline::ActionTicks> clock(stages);
  for (int k = 0; k < stages; ++k) {
    if (schedule.split_backward) {
      clock[k] = {ticks_of(per[k].f + per[k].comm_f), ticks_of(per[k].b + per[k].comm_b), ticks_of(per[k].w)};
    } else {  // a whole backward takes B's ticks and W's together (pipeline::simulate)
      const int whole = std::max(2, ticks_of(per[k].b + per[k].w + per[k].comm_b));
      clock[k] = {ticks_of(per[k].f + per[k].comm_f), whole - 1, 1};
    }
  }
  const pipeline::Timeline timeline = pipeline::simulate(schedule, clock);
  StepTimes t;
  double busiest = 0.0;
  for (int d = 0; d < s.P; ++d) {
    double work = 0.0, comm_seconds = 0.0;
    for (const pipeline::Action& a : schedule.per_device[d]) {
      const Seconds& x = per[a.stage];
      if (a.kind == pipeline::Action::Kind::kForward) {
        work += x.f, comm_seconds += x.comm_f;
      } else if (a.kind == pipeline::Action::Kind::kBackward) {
        work += x.b + (schedule.split_backward ? 0.0 : x.w), comm_seconds += x.comm_b;
      } else {
        work += x.w;
      }
    }
    if (work + comm_seconds > busiest) busiest = work + comm_seconds, t.compute = work, t.comm = comm_seconds;
  }
  t.bubble = std::max(0.0, timeline.ticks * tick - busiest);
  // The tied wte's gradient, summed between the first and the last stage once a step.
  const double wte = static_cast<double>(q.config.vocab_size * q.config.n_embd) / s.T * 4.0;
  t.comm += collective_seconds(Collective::kAllReduce, wte, 2, s.pipeline);
  return t;
}

// The gradients' synchronisation over the D x C ranks holding the same slice: what the backward
// does not hide. Buckets overlap the backward but the last; ZeRO-1/2 reduce-scatter, then
// all-gather the stepped weights; ZeRO-3 all-gathers every unit for the forward and again for the
// backward (prefetched behind the compute) and reduce-scatters its gradients.
double gradient_seconds(const PlanQuestion& q, const Plan& plan, const Shapes& s, int64_t parameters,
                        double backward_seconds, double compute_seconds) {
  const int G = s.D * s.C;
  if (G <= 1) return 0.0;
  const double reduce_bytes = plan.gradient_sync.reduce_dtype == at::kBFloat16 ? 2.0 : 4.0;
  const double gradients = static_cast<double>(parameters) * reduce_bytes;
  const double bucket = std::min(gradients, plan.gradient_sync.bucket_cap_mb * 1024 * 1024);
  const int stage = plan.zero.stage;
  const Collective reduce = stage == 0 ? Collective::kAllReduce : Collective::kReduceScatter;
  const double whole = collective_seconds(reduce, gradients, G, s.gradient);
  const double last = collective_seconds(reduce, bucket, G, s.gradient);
  double exposed = std::max(last, whole - backward_seconds);
  const double weights = static_cast<double>(parameters) * 4.0;
  if (stage == 1 || stage == 2) exposed += collective_seconds(Collective::kAllGather, weights, G, s.gradient);
  if (stage == 3) {
    const double gathers = 2.0 * collective_seconds(Collective::kAllGather, weights, G, s.gradient);
    exposed = std::max(last, whole + gathers - compute_seconds);
  }
  return exposed;
}

// The memory plan of the layout (plan/memory_plan.h).
MemoryPlan memory_of(const PlanQuestion& q, const Plan& plan, const Shapes& s) {
  MemoryPlanInput in;
  in.program = "run_data_parallel";
  in.model_name = q.model_name;
  in.config = q.config;
  in.plan = plan;
  in.rows_per_replica = s.replica_rows;
  in.tokens = s.rank_tokens;
  in.bf16 = q.bf16;
  if (s.P > 1) {
    PipelineStepOptions options = pipeline_step_options(plan.pipeline, s.P);
    options.balance_halves = s.halves;
    plan_stages(in, s.P, options, /*balance_by_time=*/false);
  }
  return plan_memory(in);
}

}  // namespace

StepPrediction predict_step(const PlanQuestion& q, const Plan& plan) {
  const Shapes s = shapes_of(q, plan);
  const MemoryPlan memory = memory_of(q, plan, s);
  const RankMemory& largest = memory.largest_model_state();
  StepPrediction p;
  p.plan = plan;
  const StepTimes t = s.P > 1 ? pipeline_times(q, plan, s) : whole_model_times(q, plan, s);
  p.compute_seconds = t.compute;
  p.bubble_seconds = t.bubble;
  // The last micro-batch's backward hides the buckets but the last (about two thirds of its work).
  const double backward = 2.0 / 3.0 * t.compute / s.M;
  p.exposed_comm_seconds = t.comm + gradient_seconds(q, plan, s, largest.parameters, backward, t.compute);
  // AdamW reads the weight, the gradient and both moments and writes all but the gradient.
  const double stepped = static_cast<double>(largest.optimizer_bytes) / 8.0;
  p.optimizer_seconds = stepped * 7.0 * 4.0 / q.machine.memory_bytes_per_second;
  p.step_seconds = p.compute_seconds + p.bubble_seconds + p.exposed_comm_seconds + p.optimizer_seconds;
  const double tokens = static_cast<double>(q.batch_size * q.sequence_length);
  p.tokens_per_second = tokens / p.step_seconds;
  const double peak = (q.bf16 ? q.machine.bf16_flops : q.machine.fp32_flops) * plan.world_size;
  p.mfu = model_training_flops(q.config, tokens, q.sequence_length) / (p.step_seconds * peak);
  for (const RankMemory& r : memory.kinds) p.memory_bytes_per_device = std::max(p.memory_bytes_per_device, r.total_bytes());
  p.fits = p.memory_bytes_per_device <= q.machine.memory_bytes;
  if (!p.fits) {
    p.why_not = std::to_string(p.memory_bytes_per_device) + " bytes a device (" + largest.who + ") against " +
                std::to_string(q.machine.memory_bytes);
  }
  return p;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

// The pipeline choices of P > 1 stages for replicas of `rows` rows: each schedule at P, 2P and 4P
// micro-batches, with activation checkpointing off and on; P = 1 has none.
std::vector<PipelineScheduleConfig> pipeline_choices(int P, int64_t rows) {
  if (P == 1) {
    PipelineScheduleConfig whole;
    whole.n_chunk = 1;
    return {whole};
  }
  std::vector<PipelineScheduleConfig> out;
  for (const pipeline::ScheduleKind kind :
       {pipeline::ScheduleKind::kOneFOneB, pipeline::ScheduleKind::kInterleaved, pipeline::ScheduleKind::kZb1p}) {
    for (const int64_t M : {P, 2 * P, 4 * P}) {
      if (M > rows) continue;
      for (const auto checkpointing : {pipeline::ActivationCheckpointing::kNever, pipeline::ActivationCheckpointing::kAlways}) {
        PipelineScheduleConfig c;
        c.n_chunk = M;
        c.schedule = kind;
        c.virtual_stages = kind == pipeline::ScheduleKind::kInterleaved ? 2 : 1;
        c.activation_checkpointing = checkpointing;
        out.push_back(c);
      }
    }
  }
  return out;
}

}  // namespace

std::vector<StepPrediction> rank_layouts(const PlanQuestion& q, int world_size) {
  std::vector<StepPrediction> out;
  for (const int T : divisors(world_size)) {
    for (const int C : divisors(world_size / T)) {
      for (const int P : divisors(world_size / T / C)) {
        const int D = world_size / T / C / P;
        if (q.batch_size % D != 0) continue;
        for (const bool sequence_parallel : {false, true}) {
          if (sequence_parallel && T == 1) continue;
          for (int zero = 0; zero <= 3; ++zero) {
            for (const PipelineScheduleConfig& pipe : pipeline_choices(P, q.batch_size / D)) {
              Plan plan;
              plan.world_size = world_size;
              plan.tensor_parallel_size = T, plan.context_parallel_size = C, plan.pipeline_parallel_size = P;
              plan.sequence_parallel = sequence_parallel;
              plan.zero.stage = zero;
              plan.pipeline = pipe;
              try {
                out.push_back(predict_step(q, plan));
              } catch (const std::invalid_argument&) {
                // A layout this model or batch cannot take: not listed.
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const StepPrediction& a, const StepPrediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.tokens_per_second > b.tokens_per_second;
  });
  return out;
}

json predictions_to_json(const PlanQuestion& q, int world_size, const std::vector<StepPrediction>& predictions) {
  json layouts = json::array();
  for (const StepPrediction& p : predictions) {
    const Plan& plan = p.plan;
    layouts.push_back({{"data", plan.data_parallel_size()},
                       {"context", plan.context_parallel_size},
                       {"tensor", plan.tensor_parallel_size},
                       {"pipeline", plan.pipeline_parallel_size},
                       {"sequence_parallel", plan.sequence_parallel},
                       {"zero_stage", plan.zero.stage},
                       {"schedule", pipeline::to_string(plan.pipeline.schedule)},
                       {"n_chunk", plan.pipeline_parallel_size > 1 ? plan.pipeline.n_chunk : 1},
                       {"activation_checkpointing", pipeline::to_string(plan.pipeline.activation_checkpointing)},
                       {"tokens_per_sec", p.tokens_per_second},
                       {"step_seconds", p.step_seconds},
                       {"compute_seconds", p.compute_seconds},
                       {"exposed_comm_seconds", p.exposed_comm_seconds},
                       {"bubble_seconds", p.bubble_seconds},
                       {"optimizer_seconds", p.optimizer_seconds},
                       {"memory_bytes_per_device", p.memory_bytes_per_device},
                       {"fits", p.fits},
                       {"why_not", p.why_not},
                       {"mfu", p.mfu}});
  }
  return {{"machine", q.machine.name}, {"model", q.model_name}, {"world_size", world_size}, {"layouts", layouts}};
}

}  // namespace harness::train
