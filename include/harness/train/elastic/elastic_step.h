// Elastic training as the driver sees it (driver.h): a TrainStep whose steps survive a lost
// data-parallel replica (elastic_trainer.h). The driver hands each step this process's own
// batches, as in any layout; the batches of replicas that were dropped come from a mirror of their
// loaders, kept at the driver's position, so that the survivors train the undisturbed run's rows.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "harness/data/collate.h"
#include "harness/data_parallel/sharded_loader.h"
#include "harness/train/run/driver.h"
#include "harness/train/elastic/elastic_trainer.h"
#include "harness/train/step/train_step.h"

namespace harness::train {

// Every original replica's training batches at the position of this process's own loader. Replica
// r's loader is made the first time its batches are asked for (a run that loses none makes none).
class ReplicaBatchMirror {
 public:
  // Replica r's loader over the epochs (its partition of the training set, as its own process
  // made it).
  using MakeLoader = std::function<std::unique_ptr<data_parallel::ShardedLoader>(int replica)>;
  explicit ReplicaBatchMirror(MakeLoader make);
  ~ReplicaBatchMirror();

  // The driver starts `epoch` at its batch `first_batch` (TrainingData::epoch_started).
  void start_epoch(int64_t epoch, int64_t first_batch);
  // Replica r's next `count` batches from the current position (fewer at its epoch's end), the
  // same ones until advance().
  const std::vector<data::Batch>& batches(int replica, int64_t count);
  // This step's batches are trained: the position moves `count` batches on.
  void advance(int64_t count);
  // Where the driver stands: the epoch, and its next batch.
  ElasticTrainer::DataPosition position() const { return {epoch_, position_}; }

 private:
  struct Replica {
    std::unique_ptr<data_parallel::ShardedLoader> loader;
    int64_t epoch = -1, position = -1;  // where its loader stands
    std::vector<data::Batch> step;      // the batches of the current position, once read
    bool read = false;
  };
  MakeLoader make_;
  int64_t epoch_ = 0, position_ = 0;
  std::map<int, Replica> replicas_;
};

// ElasticTrainer behind the TrainStep interface. The processes are numbered by their launch rank
// (RANK at start); `world()` is the current generation's, whose rank 0 writes checkpoints and the
// final model. A replacement (ElasticSettings::join_id, `world` its store alone) joins while it is
// constructed, and then trains from joined_at().
class ElasticTrainStep : public TrainStep {
 public:
  ElasticTrainStep(model::GPT2LMHeadModel model, StepComposition composition, data_parallel::DistOptions options,
                   data_parallel::DistContext world, ReplicaBatchMirror& mirror, ElasticSettings settings,
                   TrainStepSettings step_settings = {});

  // One optimizer step: `batches` are this process's own replica's; the survivors' shares of
  // dropped replicas are added from the mirror. A lost process is recovered from inside (the step
  // is taken again over the next generation).
  double step(const std::vector<data::Batch>& batches) override;
  using TrainStep::step;
  c10::Device input_device() const override;
  void set_training(bool training) override { trainer_.current().set_training(training); }
  void set_learning_rate(double learning_rate) override { trainer_.current().set_learning_rate(learning_rate); }
  double learning_rate() const override;
  double last_grad_norm() const override;
  model::GPT2LMHeadModel model() override { return trainer_.current().model(); }
  model::GPT2LMHeadModel gathered_model() override { return trainer_.current().gathered_model(); }
  double validation_loss(data::BatchLoader& loader) override { return trainer_.current().validation_loss(loader); }
  std::vector<std::string> generate(const data::Tokenizer& tokenizer,
                                    const std::vector<data::TranslationExample>& examples, int64_t model_max_length,
                                    bool show_progress) override {
    return trainer_.current().generate(tokenizer, examples, model_max_length, show_progress);
  }
  OptimizerState optimizer_state() override { return trainer_.current().optimizer_state(); }
  bool collective_state() const override { return trainer_.current().collective_state(); }
  GeneratorStates extra_generator_states() override { return trainer_.current().extra_generator_states(); }
  void restore_extra_generator_states(const GeneratorStates& states) override {
    trainer_.current().restore_extra_generator_states(states);
  }
  void save_state(const std::string& weights_path, const std::string& optimizer_path, bool write) override {
    trainer_.current().save_state(weights_path, optimizer_path, write);
  }
  void save_model(const std::string& dir, bool write) override { trainer_.current().save_model(dir, write); }
  void load_state(const model::NamedTensors& weights, const OptimizerState& optimizer) override {
    trainer_.current().load_state(weights, optimizer);
  }
  model::NamedTensors unsplit_gradients() override { return trainer_.current().unsplit_gradients(); }
  void set_global_step(int64_t global_step) override;

  const data_parallel::DistContext& world() const { return trainer_.world(); }
  // A replacement's place in the run, where its driver starts: the step it joins at and where
  // the data stood then.
  std::optional<TrainingOptions::JoinedAt> joined_at() const;
  const ElasticTrainer& trainer() const { return trainer_; }
  // The membership changes since the last call.
  std::vector<MembershipRecord> take_membership_changes();

 private:
  ReplicaBatchMirror& mirror_;
  ElasticTrainer trainer_;
  const std::vector<data::Batch>* own_ = nullptr;  // during step()
  int64_t global_step_ = 0;
  size_t reported_events_ = 0;
};

}  // namespace harness::train
