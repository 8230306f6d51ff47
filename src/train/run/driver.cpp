// The training driver (see driver.h): the epoch loop, evaluation and SPEC §7's reports, and
// checkpoints: what they hold, when they are written, how a run resumes from one.
#include "harness/train/run/driver.h"

#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "harness/data_parallel/checkpoint_io.h"
#include "harness/data_parallel/process_group.h"
#include "harness/model/safetensors.h"
#include "harness/pipeline/activation_meter.h"
#include "harness/trace.h"
#include "harness/train/checkpoint/async_checkpoint.h"
#include "harness/train/bleu.h"
#include "harness/train/checkpoint/checkpoint_store.h"
#include "harness/train/run/metrics_log.h"
#include "harness/train/rank_agreement.h"
#include "harness/train/setup.h"
#include "harness/train/run/trainer.h"

namespace harness::train {
namespace {

namespace fs = std::filesystem;
namespace dp = harness::data_parallel;
using json = nlohmann::json;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// ----- the figures of each rank, kept across a resume ------------------------------------------

struct RankProgress {
  std::vector<double> seconds, rates;  // completed epochs
  EpochTiming partial;                 // the part of the epoch under way trained so far
};

json timing_to_json(const EpochTiming& t) {
  return {{"seconds", t.seconds}, {"tokens", t.tokens}, {"batches", t.batches},
          {"batch_token_rates", t.batch_token_rates}};
}

EpochTiming timing_from_json(const json& j) {
  EpochTiming t;
  t.seconds = j.at("seconds").get<double>();
  t.tokens = j.at("tokens").get<int64_t>();
  t.batches = j.at("batches").get<int64_t>();
  t.batch_token_rates = j.at("batch_token_rates").get<std::vector<double>>();
  return t;
}

// ----- collectives the driver issues (every rank, the same order) -------------------------------

// The smallest and largest of every rank's value.
std::pair<int64_t, int64_t> min_max(int64_t value, const dp::DistContext* world) {
  if (world == nullptr || world->world_size == 1) return {value, value};
  at::Tensor t = torch::tensor({value, -value}, torch::kLong).to(world->device.torch_device());
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  world->group->allreduce(tensors, options)->wait();
  const at::Tensor out = tensors[0].to(torch::kCPU);
  return {-out[1].item<int64_t>(), out[0].item<int64_t>()};
}

// ----- writing a checkpoint ---------------------------------------------------------------------

struct Position {
  int64_t epoch = 0;           // the epoch under way (or the next one, batch 0)
  int64_t batch_in_epoch = 0;  // its batches trained
  int64_t global_step = 0;
};

std::string checkpoint_root(const TrainingOptions& o) {
  return o.checkpoint.dir.empty() ? (fs::path(o.workdir) / "checkpoints").string() : o.checkpoint.dir;
}

// The flags the learning rate of every step derives from (with the epochs and batches, recorded
// beside), as the checkpoint records them: a resume with others says so.
std::string schedule_text(const TrainingOptions& o) {
  const LrSchedule& s = o.controls.lr_schedule;
  return "--lr_schedule " + to_string(s.kind) + " --learning_rate " + format_number(o.learning_rate) +
         " --warmup_steps " + std::to_string(s.warmup_steps) + " --min_learning_rate " +
         format_number(s.min_learning_rate) + " --max_steps " + std::to_string(o.controls.max_steps) +
         " --gradient_accumulation_steps " + std::to_string(o.gradient_accumulation_steps);
}

// What a checkpoint holds besides the state files, captured on the training thread.
struct CheckpointRecord {
  Position at;
  model::GPT2Config config;
  std::string tokenizer;
  json trainer_state;
  json rank_states;
  CheckpointManifest manifest;
};

CheckpointRecord checkpoint_record(TrainStep& step, const TrainingOptions& o, const Position& at,
                                   const std::vector<std::string>& ranks) {
  CheckpointRecord r;
  r.at = at;
  r.config = step.model()->config();
  r.tokenizer = read_bytes(o.tokenizer_path);
  r.trainer_state = {
      {"epoch", at.epoch}, {"batch_in_epoch", at.batch_in_epoch}, {"global_step", at.global_step},
      {"n_epochs", o.n_epochs}, {"max_batches", o.max_batches},
      {"global_batch_size", o.global_batch_size}, {"seed", o.seed}, {"data_order", o.data_order},
      {"optimizer", "AdamW"}, {"learning_rate_schedule", schedule_text(o)}};
  r.rank_states = {{"ranks", json::array()}};
  for (const std::string& rank : ranks) r.rank_states["ranks"].push_back(json::parse(rank));
  r.manifest.program = o.program;
  r.manifest.plan = plan_to_json(o.plan);
  r.manifest.pipeline_devices = o.pipeline_devices;
  r.manifest.model_config = json::parse(r.config.to_json_string());
  r.manifest.global_step = at.global_step;
  r.manifest.epoch = at.epoch;
  r.manifest.batch_in_epoch = at.batch_in_epoch;
  return r;
}

// This rank's generator states and figures, gathered from every rank (a collective).
std::vector<std::string> gather_rank_states(TrainStep& step, const TrainingOptions& o, const RankProgress& progress,
                                            const dp::DistContext* world) {
  GeneratorStates generators = capture_generator_states(o.devices);
  for (auto& [name, bytes] : step.extra_generator_states()) generators[name] = bytes;
  json mine = {{"rank", o.rank}, {"generators", json::object()},
               {"epoch_seconds", progress.seconds}, {"epoch_token_rates", progress.rates},
               {"partial_epoch", timing_to_json(progress.partial)}};
  for (const auto& [name, bytes] : generators) mine["generators"][name] = to_hex(bytes);
  return all_gather_strings(mine.dump(), world);
}

// The files after the state files (written into `files` already): then the manifest, which makes
// the checkpoint complete, and the pruning of older ones.
void finish_checkpoint(CheckpointWriter& files, const CheckpointRecord& r, const TrainingOptions& o, double start) {
  files.add_file("config.json");
  files.add_file("model.safetensors");
  files.add_file("optimizer.safetensors");
  files.add_bytes("tokenizer.model", r.tokenizer);
  files.add_bytes("trainer_state.json", r.trainer_state.dump(2) + "\n");
  files.add_bytes("rank_states.json", r.rank_states.dump() + "\n");
  if (const char* stall = std::getenv("HARNESS_TEST_CHECKPOINT_STALL_MS")) {
    // Test hook: a window in which the checkpoint is half written, announced on stderr.
    std::cerr << "checkpoint: writing " << files.temp_path() << std::endl;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(stall)));
  }
  const std::string path = files.commit(r.manifest);
  prune_checkpoints(checkpoint_root(o), std::max(1, o.checkpoint.keep));
  uint64_t bytes = 0;
  for (const auto& f : read_manifest(path).files) bytes += f.size;
  std::cerr << "checkpoint: saved " << path << " (step " << r.at.global_step << ", epoch " << r.at.epoch
            << ", batch " << r.at.batch_in_epoch << ", " << std::fixed << std::setprecision(1)
            << bytes / 1e6 << " MB in " << std::setprecision(3) << now_seconds() - start << " s)"
            << std::defaultfloat << std::endl;
}

// --async_checkpoint's parts: the host buffers the state is copied into, and the writer thread.
struct AsyncCheckpoints {
  HostSnapshot host;
  BackgroundWriter writer;
};

// Until rank 0 has done what `what` names (written a checkpoint, finished the previous background
// write) the other ranks wait here, polling the rendezvous store, not in a collective, which
// --dist_timeout_s bounds: a save may take longer than that (GPT-2 XL).
void wait_for_the_writer(const std::string& what, int64_t global_step, bool writer, const dp::DistContext* world,
                         const std::function<void()>& peers_alive = nullptr) {
  if (world == nullptr || world->world_size == 1 || !world->store) return;
  const std::string key = "harness/" + what + "/" + std::to_string(global_step);
  if (writer) {
    world->store->set(key, std::vector<uint8_t>{1});
    return;
  }
  for (int wait_ms = 1; !world->store->check({key}); wait_ms = std::min(2 * wait_ms, 100)) {
    if (peers_alive) peers_alive();  // under --elastic a lost writer must not leave the others here
    std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
  }
}

// Who writes checkpoints and the final model: rank 0, or under --elastic the current world's
// rank 0 (the first one may have been lost).
bool is_writer(const TrainingOptions& o, const dp::DistContext* world) {
  return o.elastic && world != nullptr ? world->rank == 0 : o.rank == 0;
}

void write_checkpoint(TrainStep& step, const TrainingOptions& o, const Position& at,
                      const RankProgress& progress, const dp::DistContext* world, AsyncCheckpoints* async) {
  const bool writer = is_writer(o, world);
  const bool collective = step.collective_state();  // unsplitting gathers (tensor parallelism, ZeRO)
  const double start = now_seconds();
  const std::string root = checkpoint_root(o);
  if (async != nullptr) {
    // The previous write must be done before its buffers are refilled (its error surfaces here);
    // meanwhile the other ranks wait outside the collectives below.
    if (writer) async->writer.wait();
    wait_for_the_writer("ready_to_checkpoint", at.global_step, writer, world, o.peers_alive);
    const double copy_start = now_seconds();
    // Every rank takes part in the gathers of a split or sharded state; only the writer keeps it.
    model::GPT2LMHeadModel model = step.gathered_model();
    model::NamedTensors weights;
    if (model->tensor_parallel() == nullptr) {
      if (writer) {
        for (const auto& item : model->named_parameters()) {
          weights.emplace_back(item.key(), async->host.copy("weight:" + item.key(), item.value()));
        }
      }
    } else {
      weights = model->full_state();  // collective; fresh host tensors
    }
    // The AdamW state comes as fresh host copies already (gathered where split or sharded).
    OptimizerState optimizer;
    if (writer || collective) optimizer = step.optimizer_state();
    if (!writer) optimizer.clear();
    async->host.finish();
    const std::vector<std::string> ranks = gather_rank_states(step, o, progress, world);
    if (!writer) return;
    make_directories(root);
    auto record = std::make_shared<CheckpointRecord>(checkpoint_record(step, o, at, ranks));
    auto state = std::make_shared<std::pair<model::NamedTensors, OptimizerState>>(std::move(weights), std::move(optimizer));
    std::cerr << "checkpoint: step " << at.global_step << " copied to host memory in " << std::fixed
              << std::setprecision(3) << now_seconds() - copy_start << " s (training stalled "
              << now_seconds() - start << " s); writing it in the background" << std::defaultfloat << std::endl;
    async->writer.submit([record, state, &o, root] {
      const double write_start = now_seconds();
      CheckpointWriter files(root, record->at.global_step);
      record->config.save_json_file(files.path_for("config.json"));
      model::write_safetensors(files.path_for("model.safetensors"), state->first);
      write_optimizer_state(files.path_for("optimizer.safetensors"), state->second);
      finish_checkpoint(files, *record, o, write_start);
    });
    return;
  }
  std::unique_ptr<CheckpointWriter> files;
  if (writer) {
    make_directories(root);
    files = std::make_unique<CheckpointWriter>(root, at.global_step);
    step.model()->config().save_json_file(files->path_for("config.json"));
  }
  if (writer || collective) {
    step.save_state(writer ? files->path_for("model.safetensors") : std::string(),
                    writer ? files->path_for("optimizer.safetensors") : std::string(), writer);
  }
  const std::vector<std::string> ranks = gather_rank_states(step, o, progress, world);
  if (writer) finish_checkpoint(*files, checkpoint_record(step, o, at, ranks), o, start);
  wait_for_the_writer("checkpoint_written", at.global_step, writer, world, o.peers_alive);
}

// A checkpoint. Under --elastic, one that a lost process interrupts (in its gathers, or while the
// others wait for the writer) is abandoned: the previous one stays whole, and the next step's
// collective fails and recovers (train/elastic/elastic_step.h).
void save_checkpoint(TrainStep& step, const TrainingOptions& o, const Position& at,
                     const RankProgress& progress, const dp::DistContext* world, AsyncCheckpoints* async) {
  try {
    write_checkpoint(step, o, at, progress, world, async);
  } catch (const std::exception& e) {
    if (!o.elastic || !o.lost_peer || !o.lost_peer(e)) throw;
    const std::string what = e.what();
    std::cerr << "checkpoint: step " << at.global_step << " abandoned, a process was lost ("
              << what.substr(0, what.find('\n')) << "); the previous checkpoint stays, training goes on" << std::endl;
  }
}

// ----- choosing and loading a checkpoint ---------------------------------------------------------

struct Resumption {
  std::string path;
  CheckpointManifest manifest;
  json trainer_state;
  json rank_states;
};

// Throws naming what differs when the checkpoint cannot continue this run.
Resumption check_checkpoint(const std::string& path, const TrainingOptions& o,
                            const model::GPT2Config& config) {
  Resumption r;
  r.path = path;
  r.manifest = verify_checkpoint(path);  // sizes and hashes of every file
  const json ours = json::parse(config.to_json_string());
  for (const char* key : {"n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "n_inner"}) {
    const json theirs = r.manifest.model_config.value(key, json());
    const json here = ours.value(key, json());
    if (theirs != here) {
      throw std::runtime_error(path + ": the model differs: " + key + " is " + theirs.dump() +
                               " in the checkpoint and " + here.dump() + " in this run");
    }
  }
  const std::string tokenizer = (fs::path(path) / "tokenizer.model").string();
  if (sha256_file(tokenizer) != sha256_file(o.tokenizer_path)) {
    throw std::runtime_error(tokenizer + " differs from this run's tokenizer " + o.tokenizer_path +
                             " (another corpus, --train_size or vocabulary)");
  }
  r.trainer_state = json::parse(read_bytes((fs::path(path) / "trainer_state.json").string()));
  r.rank_states = json::parse(read_bytes((fs::path(path) / "rank_states.json").string()));
  const int64_t batch = r.trainer_state.at("global_batch_size").get<int64_t>();
  if (batch != o.global_batch_size) {
    throw std::runtime_error(path + ": trained with --batch_size " + std::to_string(batch) +
                             ", this run has " + std::to_string(o.global_batch_size) +
                             " (a position inside an epoch means nothing with another batch)");
  }
  if (r.rank_states.at("ranks").empty()) throw std::runtime_error(path + ": rank_states.json lists no rank");
  return r;
}

std::optional<Resumption> choose_checkpoint(const TrainingOptions& o, const model::GPT2Config& config) {
  const std::string& resume = o.checkpoint.resume;
  if (resume == "none") return std::nullopt;
  const bool automatic = resume == "auto";
  const std::string root = checkpoint_root(o);
  std::vector<std::string> candidates;
  if (automatic) {
    const std::vector<CheckpointInfo> found = list_checkpoints(root);
    for (auto it = found.rbegin(); it != found.rend(); ++it) candidates.push_back(it->path);
  } else {
    candidates.push_back(resume);
  }
  const bool talk = o.rank == 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    try {
      return check_checkpoint(candidates[i], o, config);
    } catch (const std::exception& e) {
      if (!automatic) throw std::runtime_error(std::string("--resume: ") + e.what());
      if (talk) {
        std::cerr << "resume: refused " << candidates[i] << ": " << e.what()
                  << (i + 1 < candidates.size() ? "; falling back to the previous complete checkpoint"
                                                : "")
                  << std::endl;
      }
    }
  }
  if (talk) {
    std::cerr << "resume: no usable complete checkpoint in " << root << "; starting fresh" << std::endl;
  }
  return std::nullopt;
}

void apply_checkpoint(const Resumption& r, TrainStep& step, const TrainingOptions& o,
                      RankProgress& progress, Position& at) {
  const model::NamedTensors weights =
      model::read_safetensors((fs::path(r.path) / "model.safetensors").string());
  const OptimizerState optimizer =
      read_optimizer_state((fs::path(r.path) / "optimizer.safetensors").string());
  try {
    step.load_state(weights, optimizer);
  } catch (const std::exception& e) {
    throw std::runtime_error(r.path + ": " + e.what());
  }
  at.epoch = r.trainer_state.at("epoch").get<int64_t>();
  at.batch_in_epoch = r.trainer_state.at("batch_in_epoch").get<int64_t>();
  at.global_step = r.trainer_state.at("global_step").get<int64_t>();

  const json& ranks = r.rank_states.at("ranks");
  const json* mine = nullptr;
  for (const json& entry : ranks) {
    if (entry.at("rank").get<int>() == o.rank) mine = &entry;
  }
  const bool same_layout = r.manifest.plan_size("world_size") == o.plan.world_size &&
                           r.manifest.plan_size("tensor_parallel_size") == o.plan.tensor_parallel_size;
  // Reported figures: this rank's, or rank 0's when the checkpoint had fewer ranks.
  const json& figures = mine ? *mine : ranks.at(0);
  progress.seconds = figures.at("epoch_seconds").get<std::vector<double>>();
  progress.rates = figures.at("epoch_token_rates").get<std::vector<double>>();
  progress.partial = timing_from_json(figures.at("partial_epoch"));
  if (mine) {
    GeneratorStates defaults, extra;
    for (const auto& [name, hex] : mine->at("generators").items()) {
      std::string bytes = from_hex(hex.get<std::string>(), r.path + "/rank_states.json: " + name);
      if (name.find(':') != std::string::npos && name.rfind("cuda:", 0) != 0) {
        extra[name] = std::move(bytes);
      } else {
        defaults[name] = std::move(bytes);
      }
    }
    restore_generator_states(defaults);
    if (same_layout) step.restore_extra_generator_states(extra);
  } else {
    // A rank the checkpoint did not have: a dropout stream of its own, reproducible from the seed.
    torch::manual_seed(o.seed + static_cast<uint64_t>(o.rank) + 1000003ull * static_cast<uint64_t>(at.global_step));
  }
  if (o.rank == 0) {
    std::cerr << "resume: continuing from " << r.path << " (step " << at.global_step << ", epoch "
              << at.epoch << ", batch " << at.batch_in_epoch << ")";
    if (!same_layout) {
      std::cerr << "; it was written by " << r.manifest.program << " with world size "
                << r.manifest.plan_size("world_size") << " and tensor-parallel size "
                << r.manifest.plan_size("tensor_parallel_size") << ", this run has " << o.plan.world_size << " and "
                << o.plan.tensor_parallel_size << ": weights and optimizer state carry over, the "
                << "interrupted epoch continues at batch " << at.batch_in_epoch
                << " of this layout's data order";
    }
    const std::string schedule = r.trainer_state.value("learning_rate_schedule", std::string());
    if (!schedule.empty() && schedule != schedule_text(o)) {
      std::cerr << "; the learning-rate schedule differs (checkpoint: " << schedule << "; this run: "
                << schedule_text(o) << "): the steps from here take this run's rates";
    }
    const std::string order = r.trainer_state.value("data_order", std::string());
    if (order != o.data_order) {
      std::cerr << "; the data order differs (checkpoint: " << order << "; this run: " << o.data_order << ")";
    }
    std::cerr << std::endl;
  }
}

// Checkpoints beyond where this run starts belong to another run: pruning would keep them as the
// newest and delete this run's own. Refused before any training, with what to do. (With
// --resume auto, anything later was refused as damaged; the run overwrites those steps as it goes.)
void refuse_later_checkpoints(const TrainingOptions& o, const std::optional<Resumption>& resumption) {
  const int64_t start = resumption ? resumption->manifest.global_step : 0;
  std::string later;
  for (const CheckpointInfo& found : list_checkpoints(checkpoint_root(o))) {
    if (found.global_step > start) later += (later.empty() ? "" : ", ") + found.path;
  }
  if (!later.empty()) {
    throw std::invalid_argument(
        checkpoint_root(o) + " holds checkpoints of another run beyond step " + std::to_string(start) + " (" +
        later + "); this run's would be mixed with them. Pass --resume auto to continue that run, or another "
        "--checkpoint_dir (or remove those folders) to start a new one");
  }
}

std::string line_prefix(const TrainingOptions& o, int64_t epoch) {
  return o.style == ReportStyle::kDataParallel
             ? "Epoch " + std::to_string(epoch) + " on Rank " + std::to_string(o.report_rank) + ": "
             : "Epoch " + std::to_string(epoch) + ": ";
}

// The evaluation lines and the epoch's results and generations files.
void report_evaluation(const TrainingOptions& o, int64_t epoch, const EpochEvaluation& eval, double seconds,
                       double rate, const std::vector<data::TranslationExample>& test) {
  const std::string prefix = line_prefix(o, epoch);
  std::cout << prefix << "Validation Loss = " << format_number(eval.validation_loss) << std::endl;
  std::cout << prefix << "BLEU = " << format_number(eval.bleu) << std::endl;
  const std::string e = std::to_string(epoch);
  const bool data_parallel = o.style == ReportStyle::kDataParallel;
  const std::string base = data_parallel ? (fs::path(o.workdir) / ("rank" + std::to_string(o.report_rank))).string()
                                         : (fs::path(o.workdir) / "").string();
  write_results_json(data_parallel ? base + "_results_epoch" + e + ".json" : base + "eval_results_epoch" + e + ".json",
                     {eval.validation_loss, eval.bleu, seconds, rate});
  write_generations_json(data_parallel ? base + "_gen_epoch" + e + ".json" : base + "gen_epoch" + e + ".json", test,
                         eval.generations);
}

// The run's optimizer steps: --n_epochs epochs of ceil(batches / accumulation) steps each (the
// last step of an epoch takes what is left), or --max_steps where fewer. The schedule decays over
// them, the same number whether the run starts fresh or resumes.
int64_t run_training_steps(const data::BatchLoader& loader, const TrainingOptions& o) {
  const int64_t batches = batches_in_epoch(loader, o.max_batches);
  const int64_t per_epoch = (batches + o.gradient_accumulation_steps - 1) / o.gradient_accumulation_steps;
  const int64_t steps = o.n_epochs * per_epoch;
  return o.controls.max_steps > 0 ? std::min(steps, o.controls.max_steps) : steps;
}

// --eval_every: the validation loss after `global_step` steps, printed (as the epoch lines' rank)
// and logged; every rank of a split model takes part. Training mode is restored after.
void evaluate_at_step(TrainStep& step, const TrainingData& data, const TrainingOptions& o, int64_t epoch,
                      int64_t global_step, MetricsLog* metrics) {
  const double loss = step.validation_loss(*data.validation);
  step.set_training(true);
  if (o.reports) {
    std::cout << "Step " << global_step
              << (o.style == ReportStyle::kDataParallel ? " on Rank " + std::to_string(o.report_rank) : std::string())
              << ": Validation Loss = " << format_number(loss) << std::endl;
  }
  if (metrics) metrics->log(EvalMetrics{global_step, epoch, loss});
}

}  // namespace

EpochEvaluation evaluate_epoch(TrainStep& step, data::BatchLoader& validation, const data::Tokenizer& tokenizer,
                               const std::vector<data::TranslationExample>& test, int64_t model_max_length,
                               bool progress) {
  EpochEvaluation out;
  out.validation_loss = step.validation_loss(validation);
  out.generations = step.generate(tokenizer, test, model_max_length, progress);
  std::vector<std::string> references;
  references.reserve(test.size());
  for (const auto& example : test) references.push_back(example.en);
  out.bleu = corpus_bleu(out.generations, references);
  return out;
}

namespace {

// One call of run_training: the run's position and figures, the metrics log and the background
// writer, and the steps from choosing a checkpoint to the closing line.
class TrainingRun {
 public:
  TrainingRun(TrainStep& step, const TrainingData& data, const TrainingOptions& o, const dp::DistContext* world)
      : step_(step), data_(data), o_(o), world_(world) {}

  // Chooses the checkpoint to resume (agreed by every rank) and loads it; opens the metrics log.
  void start();
  void train();
  // Waits for the last background write, prints the closing line and saves the model.
  TrainingSummary finish();

 private:
  std::optional<Resumption> agreed_resumption();
  void resume_from(const Resumption& resumption, double load_start);
  // False when the step budget ended the run inside `epoch`.
  bool train_epoch_at(int64_t epoch);
  void after_step(int64_t epoch, int64_t total, const EpochTiming& so_far);
  void end_epoch(int64_t epoch, const EpochTiming& timing);

  TrainStep& step_;
  const TrainingData& data_;
  const TrainingOptions& o_;
  const dp::DistContext* world_;
  RankProgress progress_;
  Position at_;
  TrainingSummary summary_;
  std::optional<MetricsLog> metrics_;
  std::optional<AsyncCheckpoints> async_;
  // With the CPU tensor counter on (HARNESS_COUNT_CPU_TENSORS=1): steps taken in this process, and
  // the most a step after the first allocated at once over what it holds once its gradients are
  // let go (the step's window, see GPT2TrainStep::step): its activations, and the gradients made
  // while they are held.
  int64_t counted_steps_ = 0;
  int64_t step_tensor_increase_ = 0;
};

// Which checkpoint, if any: every rank decides alone, then all must agree before anything that
// depends on it (collectives included) happens. A rank that refuses to start (a --resume it cannot
// use, another run's checkpoints in the folder) refuses for all, with its reason, so that no rank
// is left waiting in a collective for a peer that is gone. What would otherwise fail after
// training (evaluation, the first checkpoint) fails now.
std::optional<Resumption> TrainingRun::agreed_resumption() {
  const model::GPT2Config config = step_.model()->config();
  std::optional<Resumption> resumption;
  std::string refusal;
  try {
    check_positions(config, o_.model_max_length);
    if (o_.rank == 0) make_directories(checkpoint_root(o_));
    resumption = choose_checkpoint(o_, config);
    if (o_.rank == 0 && o_.checkpoint.resume != "auto") refuse_later_checkpoints(o_, resumption);
    if (o_.reports && o_.report_rank == 0 && !o_.workdir.empty()) {
      metrics_.emplace((fs::path(o_.workdir) / "metrics.jsonl").string(),
                       resumption ? resumption->manifest.global_step : -1, o_.controls.tensorboard_dir);
    }
  } catch (const std::exception& e) {
    if (world_ == nullptr || world_->world_size == 1) throw;
    refusal = e.what();
  }
  agree_to_go_on(refusal, world_);
  const auto [lowest, highest] = min_max(resumption ? resumption->manifest.global_step : -1, world_);
  if (lowest != highest) {
    throw std::runtime_error("ranks disagree on the checkpoint to resume (steps " + std::to_string(lowest) +
                             " and " + std::to_string(highest) + "): is " + checkpoint_root(o_) +
                             " the same folder on every machine?");
  }
  return resumption;
}

void TrainingRun::resume_from(const Resumption& resumption, double load_start) {
  apply_checkpoint(resumption, step_, o_, progress_, at_);
  summary_.resumed_from = resumption.path;
  if (o_.rank != 0) return;
  uint64_t bytes = 0;
  for (const auto& f : resumption.manifest.files) bytes += f.size;
  std::cerr << "resume: verified and loaded " << std::fixed << std::setprecision(1) << bytes / 1e6 << " MB in "
            << std::setprecision(3) << now_seconds() - load_start << " s" << std::defaultfloat << std::endl;
}

void TrainingRun::start() {
  if (o_.checkpoint.every < 0) throw std::invalid_argument("--checkpoint_every must be >= 0");
  if (o_.checkpoint.keep < 1) throw std::invalid_argument("--keep_checkpoints must be at least 1");
  if (o_.controls.max_steps < 0) throw std::invalid_argument("--max_steps must be >= 0");
  if (o_.controls.eval_every < 0) throw std::invalid_argument("--eval_every must be >= 0");
  validate_lr_schedule(o_.controls.lr_schedule, o_.learning_rate);
  const double load_start = now_seconds();
  if (o_.joined_at) {
    at_ = {o_.joined_at->epoch, o_.joined_at->batch_in_epoch, o_.joined_at->global_step};
  } else if (const std::optional<Resumption> resumption = agreed_resumption()) {
    resume_from(*resumption, load_start);
  }
  step_.set_global_step(at_.global_step);
  summary_.training_steps = run_training_steps(data_.train(at_.epoch), o_);
  if (o_.controls.async_checkpoint) async_.emplace();
}

void TrainingRun::train() {
  for (int64_t epoch = at_.epoch; epoch < o_.n_epochs && at_.global_step < summary_.training_steps; ++epoch) {
    if (!train_epoch_at(epoch)) break;
  }
}

// After each optimizer step: the metrics line, --eval_every's evaluation and --checkpoint_every's
// checkpoint (the last batch of an epoch is checkpointed after its evaluation, in end_epoch).
void TrainingRun::after_step(int64_t epoch, int64_t total, const EpochTiming& so_far) {
  ++at_.global_step;
  if (const char* folder = std::getenv("HARNESS_TEST_STEP_LOSSES"); folder != nullptr && *folder != '\0') {
    // Test and benchmark hook: every process appends "<step> <loss>" to <folder>/rank<r>.txt, so
    // that the mean over the processes that trained a step, its global loss, can be compared
    // between runs (metrics.jsonl holds one process's).
    std::ofstream(std::string(folder) + "/rank" + std::to_string(o_.rank) + ".txt", std::ios::app)
        << at_.global_step << ' ' << std::setprecision(17) << so_far.last_loss << '\n';
  }
  // The first step also allocates the gradients and AdamW's state: the model state, not activations.
  if (pipeline::activation_meter_installed() && ++counted_steps_ > 1) {
    step_tensor_increase_ = std::max(step_tensor_increase_, pipeline::cpu_tensor_window_increase());
  }
  if (data_.membership_changes) {
    const std::vector<MembershipRecord> changes = data_.membership_changes();
    if (!changes.empty() && !metrics_ && o_.keeps_metrics && o_.keeps_metrics() && !o_.workdir.empty()) {
      // The process that wrote metrics.jsonl was lost: this one goes on with it.
      metrics_.emplace((fs::path(o_.workdir) / "metrics.jsonl").string(), at_.global_step - 1,
                       o_.controls.tensorboard_dir);
    }
    if (metrics_) {
      for (const MembershipRecord& change : changes) metrics_->log(change);
    }
  }
  if (metrics_) {
    metrics_->log(StepMetrics{at_.global_step, epoch, so_far.last_loss, step_.learning_rate(), step_.last_grad_norm(),
                              so_far.last_step_tokens,
                              static_cast<double>(so_far.last_step_tokens) / so_far.last_step_seconds,
                              so_far.last_step_seconds, peak_memory_bytes(step_.input_device())});
  }
  if (o_.controls.eval_every > 0 && at_.global_step % o_.controls.eval_every == 0) {
    evaluate_at_step(step_, data_, o_, epoch, at_.global_step, metrics_ ? &*metrics_ : nullptr);
  }
  if (o_.checkpoint.every > 0 && at_.global_step % o_.checkpoint.every == 0 && so_far.batches < total) {
    progress_.partial = so_far;
    save_checkpoint(step_, o_, {epoch, so_far.batches, at_.global_step}, progress_, world_, async_ ? &*async_ : nullptr);
  }
}

bool TrainingRun::train_epoch_at(int64_t epoch) {
  data::BatchLoader& loader = data_.train(epoch);
  TrainEpochOptions options;
  options.first_batch = epoch == at_.epoch ? at_.batch_in_epoch : 0;
  // The step budget may end the run inside this epoch.
  const int64_t whole = batches_in_epoch(loader, o_.max_batches);
  const int64_t budget =
      options.first_batch + (summary_.training_steps - at_.global_step) * o_.gradient_accumulation_steps;
  const bool cut = budget < whole;
  const int64_t total = cut ? budget : whole;
  options.max_batches = total;
  options.accumulation_steps = o_.gradient_accumulation_steps;
  options.description = (o_.style == ReportStyle::kDataParallel ? "rank " + std::to_string(o_.rank) + " " : "") +
                        "epoch " + std::to_string(epoch);
  options.show_progress = o_.show_progress;
  options.tracer = o_.tracer;
  options.trace_track = o_.trace_track;
  const LrSchedule& schedule = o_.controls.lr_schedule;
  options.before_step = [&] {
    if (!schedule.constant()) {
      step_.set_learning_rate(
          scheduled_learning_rate(schedule, o_.learning_rate, at_.global_step, summary_.training_steps));
    }
  };
  options.after_step = [&](const EpochTiming& so_far) { after_step(epoch, total, so_far); };
  const EpochTiming resumed = epoch == at_.epoch ? progress_.partial : EpochTiming{};
  if (data_.epoch_started) data_.epoch_started(epoch, std::min(options.first_batch, loader.num_batches()));
  const EpochTiming timing = train_epoch(step_, loader, epoch, options, resumed);
  progress_.partial = EpochTiming{};
  end_epoch(epoch, timing);
  AsyncCheckpoints* async_files = async_ ? &*async_ : nullptr;
  if (cut) {
    // The budget ended the run inside the epoch: the checkpoint is a position in it, so that a run
    // resumed with a larger budget finishes the epoch (and reports it whole).
    RankProgress inside = progress_;
    inside.seconds.pop_back();
    inside.rates.pop_back();
    inside.partial = timing;
    save_checkpoint(step_, o_, {epoch, timing.batches, at_.global_step}, inside, world_, async_files);
    return false;
  }
  save_checkpoint(step_, o_, {epoch + 1, 0, at_.global_step}, progress_, world_, async_files);
  return true;
}

// The epoch's figures and line, then its evaluation (every rank of the group takes part).
void TrainingRun::end_epoch(int64_t epoch, const EpochTiming& timing) {
  const double rate = o_.style == ReportStyle::kDataParallel ? timing.mean_batch_token_rate()
                                                             : static_cast<double>(timing.tokens) / timing.seconds;
  progress_.seconds.push_back(timing.seconds);
  progress_.rates.push_back(rate);
  if (o_.reports) {
    std::cout << line_prefix(o_, epoch) << "Training Time = " << format_number(timing.seconds)
              << ", Tokens_per_sec = " << format_number(rate) << std::endl;
  }
  if (o_.benchmark_only) return;
  const EpochEvaluation eval =
      evaluate_epoch(step_, *data_.validation, *data_.tokenizer, *data_.test, o_.model_max_length, o_.show_progress);
  if (o_.reports) report_evaluation(o_, epoch, eval, timing.seconds, rate, *data_.test);
  if (metrics_) metrics_->log(EvalMetrics{at_.global_step, epoch, eval.validation_loss});
}

TrainingSummary TrainingRun::finish() {
  if (async_) {
    // The last checkpoint is complete before the run ends; the other ranks wait for it outside
    // any collective (a launcher must not see them exit while rank 0 still writes).
    const bool writer = is_writer(o_, world_);
    if (writer) async_->writer.wait();
    wait_for_the_writer("background_writes_done", at_.global_step, writer, world_, o_.peers_alive);
  }
  const MeanStd time_stats = mean_std(progress_.seconds), rate_stats = mean_std(progress_.rates);
  if (o_.reports) {
    std::cout << (o_.style == ReportStyle::kDataParallel ? "Rank " + std::to_string(o_.report_rank) + " training time"
                                                         : std::string("Training time"))
              << ": avg:" << format_number(time_stats.mean) << ", std:" << format_number(time_stats.std)
              << ", tokens_per_second: avg: " << format_number(rate_stats.mean)
              << ", std:" << format_number(rate_stats.std) << std::endl;
  }
  if (pipeline::activation_meter_installed()) {
    std::cerr << o_.program << ": rank " << o_.rank << "'s CPU tensors peaked at " << pipeline::cpu_tensor_peak_bytes()
              << " bytes; a training step after the first allocated at most " << step_tensor_increase_
              << " bytes over what it held once its gradients were cleared" << std::endl;
  }
  // Split or sharded, every rank takes part in gathering the weights; the writer writes them.
  if (o_.elastic) {
    step_.save_model(o_.workdir, /*write=*/is_writer(o_, world_) && !o_.workdir.empty());
  } else {
    step_.save_model(o_.save_dir, /*write=*/!o_.save_dir.empty());
  }
  summary_.epoch_seconds = progress_.seconds;
  summary_.epoch_token_rates = progress_.rates;
  summary_.global_step = at_.global_step;
  return summary_;
}

}  // namespace

TrainingSummary run_training(TrainStep& step, const TrainingData& data, const TrainingOptions& o,
                             const dp::DistContext* world) {
  TrainingRun run(step, data, o, world);
  run.start();
  run.train();
  return run.finish();
}

void write_gradients_of_one_step(TrainStep& step, data::BatchLoader& loader, const std::string& path,
                                 int64_t accumulation_steps) {
  loader.start_epoch(0);
  std::vector<data::Batch> batches;
  while (static_cast<int64_t>(batches.size()) < accumulation_steps) {
    std::optional<data::Batch> batch = loader.next();
    if (!batch) break;
    batches.push_back(batch->to(step.input_device()));
  }
  if (batches.empty()) throw std::runtime_error("--pytest: the training loader gave no batch");
  step.after_backward = [&] {
    const model::NamedTensors gradients = step.unsplit_gradients();  // collective for TP
    const fs::path file(path);
    if (file.has_parent_path()) make_directories(file.parent_path().string());
    dp::save_tensor_dict_pth(path, gradients);
  };
  step.set_training(true);
  step.step(batches);
  step.after_backward = nullptr;
}

}  // namespace harness::train
