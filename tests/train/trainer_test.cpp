// The shared training pieces: greedy generation with the KV cache equals greedy generation by
// full recomputation, one epoch lowers the loss, formatting and mean/std of the printed figures.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>

#include "harness/data/collate.h"
#include "harness/data/loader.h"
#include "harness/data/synthetic_corpus.h"
#include "harness/data/tokenizer.h"
#include "harness/model/loss.h"
#include "harness/train/loss.h"
#include "harness/train/run/report.h"
#include "harness/train/setup.h"
#include "harness/train/run/trainer.h"

namespace harness::train {
namespace {

struct Fixture {
  data::TranslationCorpus corpus;
  std::unique_ptr<data::Tokenizer> tokenizer;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture out;
    out.corpus = data::generate_corpus(7, {200, 32, 8});
    const std::string path = std::filesystem::temp_directory_path().string() + "/trainer_test_" +
                             std::to_string(::getpid()) + ".model";
    out.tokenizer = std::make_unique<data::Tokenizer>(data::Tokenizer::train(out.corpus.train, 400, path));
    std::remove(path.c_str());
    return out;
  }();
  return f;
}

model::GPT2LMHeadModel tiny_model(int64_t vocab) {
  model::GPT2Config config = model::GPT2Config::preset("gpt2-tiny");
  config.vocab_size = vocab;
  config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0;
  torch::manual_seed(3);
  model::GPT2LMHeadModel model(config);
  model->reset_parameters();
  return model;
}

// The original's generation: the whole prefix through the model for every new token.
std::vector<std::string> generate_by_recompute(model::GPT2LMHeadModel& model,
                                               const data::Tokenizer& tokenizer,
                                               const std::vector<data::TranslationExample>& examples,
                                               int64_t max_length) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::vector<std::string> out;
  for (const auto& example : examples) {
    std::vector<int64_t> ids = tokenizer.encode(example.de + data::Tokenizer::kEosDe);
    const size_t source = ids.size();
    while (static_cast<int64_t>(ids.size()) <= max_length) {
      torch::Tensor logits = model->forward(torch::tensor(ids, torch::kLong).unsqueeze(0));
      const int64_t next = logits.index({0, -1}).argmax().item<int64_t>();
      if (next == tokenizer.eos_en_id()) break;
      ids.push_back(next);
    }
    out.push_back(tokenizer.decode(std::vector<int64_t>(ids.begin() + source, ids.end())));
  }
  return out;
}

TEST(GenerateTest, KvCacheGenerationEqualsFullRecomputation) {
  const Fixture& f = fixture();
  model::GPT2LMHeadModel model = tiny_model(f.tokenizer->vocab_size());
  const int64_t max_length = 40;
  const auto cached = generate_translations(model, *f.tokenizer, f.corpus.test, max_length,
                                            torch::kCPU, /*show_progress=*/false);
  const auto recomputed = generate_by_recompute(model, *f.tokenizer, f.corpus.test, max_length);
  ASSERT_EQ(cached.size(), f.corpus.test.size());
  EXPECT_EQ(cached, recomputed);
  // An untrained model rarely stops by itself: the continuation fills the length budget.
  size_t non_empty = 0;
  for (const auto& g : cached) non_empty += g.empty() ? 0 : 1;
  EXPECT_GT(non_empty, 0u);
}

TEST(GenerateTest, RejectsAMaxLengthBeyondThePositions) {
  const Fixture& f = fixture();
  model::GPT2LMHeadModel model = tiny_model(f.tokenizer->vocab_size());
  EXPECT_THROW(generate_translations(model, *f.tokenizer, f.corpus.test,
                                     model->config().n_positions + 1, torch::kCPU, false),
               std::invalid_argument);
}

// Greedy generation never feeds more than model_max_length tokens (the token appended last is not
// fed back), so a model with exactly that many positions generates to the full budget.
TEST(GenerateTest, AMaxLengthEqualToThePositionsGeneratesToTheFullBudget) {
  const Fixture& f = fixture();
  model::GPT2LMHeadModel model = tiny_model(f.tokenizer->vocab_size());
  const int64_t positions = model->config().n_positions;
  const auto cached = generate_translations(model, *f.tokenizer, f.corpus.test, positions, torch::kCPU, false);
  EXPECT_EQ(cached, generate_by_recompute(model, *f.tokenizer, f.corpus.test, positions));
  size_t filled = 0;
  for (const auto& example : f.corpus.test) {
    const std::vector<int64_t> prompt = f.tokenizer->encode(example.de + data::Tokenizer::kEosDe);
    const std::vector<int64_t> continuation = greedy_continuation(
        model, prompt, positions, f.tokenizer->eos_en_id(), f.tokenizer->vocab_size(), torch::kCPU);
    EXPECT_LE(static_cast<int64_t>(prompt.size() + continuation.size()), positions + 1);
    filled += static_cast<int64_t>(prompt.size() + continuation.size()) == positions + 1 ? 1 : 0;
  }
  EXPECT_GT(filled, 0u);  // an untrained model rarely stops by itself
}

// A head larger than the tokenizer (a preset's vocab_size above what the corpus fills, or real
// weights with a new tokenizer): even when the extra rows win the arg-max everywhere, generation
// only ever picks the tokenizer's ids, and decoding never fails.
TEST(GenerateTest, NeverPicksIdsBeyondTheTokenizer) {
  const Fixture& f = fixture();
  const int64_t tokenizer_ids = f.tokenizer->vocab_size();
  model::GPT2LMHeadModel model = tiny_model(tokenizer_ids + 16);
  {
    torch::NoGradGuard no_grad;
    auto& transformer = model->transformer_module();
    const at::Tensor v = torch::randn({transformer.ln_f->weight.size(0)});
    transformer.ln_f->weight.zero_();
    transformer.ln_f->bias.copy_(v);  // every position's hidden state is v
    transformer.wte->weight.narrow(0, tokenizer_ids, 16).copy_(100.0 * v.expand({16, -1}));
  }
  const std::vector<int64_t> prompt = f.tokenizer->encode(f.corpus.test[0].de + data::Tokenizer::kEosDe);
  const std::vector<int64_t> unrestricted =
      greedy_continuation(model, prompt, 40, f.tokenizer->eos_en_id(), tokenizer_ids + 16, torch::kCPU);
  ASSERT_FALSE(unrestricted.empty());
  EXPECT_GE(unrestricted.front(), tokenizer_ids) << "the extra rows should win without the limit";
  const std::vector<int64_t> ids =
      greedy_continuation(model, prompt, 40, f.tokenizer->eos_en_id(), tokenizer_ids, torch::kCPU);
  for (int64_t id : ids) EXPECT_LT(id, tokenizer_ids);
  std::vector<std::string> out;
  EXPECT_NO_THROW(out = generate_translations(model, *f.tokenizer, f.corpus.test, 40, torch::kCPU, false));
  EXPECT_EQ(out.size(), f.corpus.test.size());
  EXPECT_THROW(greedy_continuation(model, prompt, 40, 0, tokenizer_ids + 17, torch::kCPU),
               std::invalid_argument);
}

// A vocabulary smaller than the corpus's characters is refused in the programs' terms (the flag to
// change), not with SentencePiece's text about its own options.
TEST(SetupTest, AVocabularyTooSmallForTheCorpusNamesWhatToChange) {
  const Fixture& f = fixture();
  model::GPT2Config config = model::GPT2Config::preset("gpt2-tiny");
  config.vocab_size = 64;
  const std::string path = std::filesystem::temp_directory_path().string() + "/small_vocab_" +
                           std::to_string(::getpid()) + ".model";
  try {
    prepare_tokenizer({}, config, f.corpus.train, path);
    FAIL() << "a 64-piece vocabulary was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("vocab_size is 64"), std::string::npos) << what;
    EXPECT_NE(what.find("--model"), std::string::npos) << what;
    EXPECT_EQ(what.find("character_coverage"), std::string::npos) << what;
  }
}

TEST(TrainEpochTest, LossFallsAndHookRunsOncePerBatch) {
  const Fixture& f = fixture();
  model::GPT2LMHeadModel model = tiny_model(f.tokenizer->vocab_size());
  const data::Tokenizer& tokenizer = *f.tokenizer;
  data::CollateFn collate = [&tokenizer](const std::vector<data::TranslationExample>& ex) {
    return data::collate(ex, tokenizer, 40);
  };
  data::BatchLoader train(f.corpus.train, collate, {16, true, 1, false, 2});
  data::BatchLoader validation(f.corpus.validation, collate, {16, false, 0, false, 2});
  GPT2TrainStep step(model, 3e-3);
  const double before = evaluate_loss(model, validation, torch::kCPU);
  int hook_calls = 0, step_calls = 0;
  step.after_backward = [&] { ++hook_calls; };
  TrainEpochOptions options;
  options.show_progress = false;
  options.after_step = [&](const EpochTiming& so_far) { EXPECT_EQ(so_far.batches, ++step_calls); };
  EpochTiming timing;
  for (int epoch = 0; epoch < 3; ++epoch) {
    step_calls = 0;
    timing = train_epoch(step, train, epoch, options);
  }
  const double after = evaluate_loss(model, validation, torch::kCPU);
  EXPECT_LT(after, before - 0.5) << "before " << before << " after " << after;
  EXPECT_EQ(hook_calls, 3 * train.num_batches());
  EXPECT_EQ(timing.batches, train.num_batches());
  EXPECT_EQ(timing.tokens, 200 * 40);  // every example counts B * T tokens of input_ids
  EXPECT_EQ(static_cast<int64_t>(timing.batch_token_rates.size()), timing.batches);
  EXPECT_GT(timing.mean_batch_token_rate(), 0.0);

  options.max_batches = 2;
  options.after_step = nullptr;
  timing = train_epoch(step, train, 3, options);
  EXPECT_EQ(timing.batches, 2);
}

// The one evaluation loop over a per-batch loss (a pipeline's stages use it too): the model's
// evaluate_loss is it over the model's forward; each pass starts from the loader's first batch,
// max_batches caps it, and a loader without batches is refused.
TEST(TrainEpochTest, EvaluateLossIsTheMeanOfAPerBatchLossOverTheLoader) {
  const Fixture& f = fixture();
  model::GPT2LMHeadModel model = tiny_model(f.tokenizer->vocab_size());
  const data::Tokenizer& tokenizer = *f.tokenizer;
  data::CollateFn collate = [&tokenizer](const std::vector<data::TranslationExample>& ex) {
    return data::collate(ex, tokenizer, 40);
  };
  data::BatchLoader validation(f.corpus.validation, collate, {16, false, 0, false, 2});
  ASSERT_GE(validation.num_batches(), 2);
  std::vector<double> losses;
  const BatchLoss loss = [&](const data::Batch& batch) {
    EXPECT_FALSE(torch::GradMode::is_enabled());
    const at::Tensor logits = model->forward(batch.input_ids);
    losses.push_back(model::weighted_cross_entropy(logits, batch.labels, batch.label_token_weights).item<double>());
    return losses.back();
  };
  model->eval();
  const double mean = evaluate_loss_with(loss, validation);
  ASSERT_EQ(static_cast<int64_t>(losses.size()), validation.num_batches());
  double sum = 0.0;
  for (double l : losses) sum += l;
  EXPECT_EQ(mean, sum / static_cast<double>(losses.size()));
  EXPECT_EQ(evaluate_loss(model, validation, torch::kCPU), mean);
  losses.clear();
  EXPECT_EQ(evaluate_loss_with(loss, validation, 1), evaluate_loss(model, validation, torch::kCPU, 1));
  EXPECT_EQ(losses.size(), 1u);
  data::BatchLoader empty(std::vector<data::TranslationExample>{}, collate, {16, false, 0, false, 2});
  EXPECT_THROW(evaluate_loss_with(loss, empty), std::runtime_error);
}

// An epoch resumed after k batches trains exactly the batches an uninterrupted epoch trains after
// its first k, and its figures cover the whole epoch.
TEST(TrainEpochTest, AResumedEpochTrainsTheRemainingBatchesOnly) {
  const Fixture& f = fixture();
  const data::Tokenizer& tokenizer = *f.tokenizer;
  data::CollateFn collate = [&tokenizer](const std::vector<data::TranslationExample>& ex) {
    return data::collate(ex, tokenizer, 40);
  };
  data::BatchLoader train(f.corpus.train, collate, {32, true, 5, false, 2});
  std::vector<std::string> seen_whole, seen_resumed;
  GPT2TrainStep whole(tiny_model(f.tokenizer->vocab_size()), 1e-3);
  TrainEpochOptions options;
  options.show_progress = false;
  const EpochTiming all = train_epoch(whole, train, 2, options);

  EpochTiming before;
  before.batches = 3;
  before.tokens = 3 * 32 * 40;
  before.seconds = 100.0;
  before.batch_token_rates = {1.0, 2.0, 3.0};
  options.first_batch = 3;
  int64_t first_seen = -1;
  options.after_step = [&](const EpochTiming& so_far) {
    if (first_seen < 0) first_seen = so_far.batches;
  };
  GPT2TrainStep rest(tiny_model(f.tokenizer->vocab_size()), 1e-3);
  const EpochTiming resumed = train_epoch(rest, train, 2, options, before);
  EXPECT_EQ(first_seen, 4);  // the first step taken is the epoch's fourth batch
  EXPECT_EQ(resumed.batches, all.batches);
  EXPECT_EQ(resumed.tokens, all.tokens);
  EXPECT_EQ(resumed.batch_token_rates.size(), all.batch_token_rates.size());
  EXPECT_EQ(resumed.batch_token_rates[1], 2.0);
  EXPECT_GT(resumed.seconds, 100.0);
}

TEST(ReportTest, NumbersArePlainDecimalsThatReadBack) {
  EXPECT_EQ(format_number(0.00001), "0.00001");
  EXPECT_EQ(format_number(12.5), "12.5");
  EXPECT_EQ(format_number(3.0), "3");
  EXPECT_EQ(format_number(1e20), "100000000000000000000");
  for (double v : {0.1, 2.0 / 3.0, 123456.789, 1e-7}) {
    const std::string s = format_number(v);
    EXPECT_EQ(s.find('e'), std::string::npos) << s;
    EXPECT_EQ(std::stod(s), v) << s;
  }
}

TEST(ReportTest, MeanAndPopulationStdAsNumpy) {
  const MeanStd s = mean_std({1.0, 2.0, 3.0, 4.0});
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.std, std::sqrt(1.25));  // np.std([1,2,3,4])
  EXPECT_DOUBLE_EQ(mean_std({5.0}).std, 0.0);
}

}  // namespace
}  // namespace harness::train
