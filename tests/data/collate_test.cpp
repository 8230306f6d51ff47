// collate on hand-made examples: concatenation, mask, truncation, padding and the shift.
#include "harness/data/collate.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "harness/data/synthetic_corpus.h"
#include "../support/multi_process.h"

namespace harness::data {
namespace {

const Tokenizer& tokenizer() {
  static const Tokenizer t = [] {
    const TranslationCorpus corpus = generate_corpus(3, SplitSizes{300, 1, 1});
    const auto path =
        std::filesystem::path(test_workers::folder_removed_at_exit("harness-collate-test")) / "tokenizer.model";
    return Tokenizer::train(corpus.train, 2000, path.string());
  }();
  return t;
}

std::vector<int64_t> row(const at::Tensor& tensor, int64_t b) {
  const at::Tensor r = tensor[b].to(torch::kInt64).contiguous();
  return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
}

// The unshifted sequence and mask of SPEC §3 for one example, before cutting and padding.
void expected_sequence(const TranslationExample& example, std::vector<int64_t>& ids,
                       std::vector<int64_t>& mask) {
  const Tokenizer& t = tokenizer();
  const auto source = t.encode(example.de + Tokenizer::kEosDe);
  const auto target = t.encode(example.en + Tokenizer::kEosEn);
  ids = source;
  ids.insert(ids.end(), target.begin(), target.end());
  mask.assign(source.size(), 0);
  mask.insert(mask.end(), target.size(), 1);
}

TEST(CollateTest, PadsConcatenatesAndShifts) {
  const Tokenizer& t = tokenizer();
  const std::vector<TranslationExample> examples = {{"der hund sieht den ball .", "the dog sees the ball ."},
                                                    {"die katze .", "the cat ."}};
  const int64_t model_max_length = 40;
  const Batch batch = collate(examples, t, model_max_length);
  ASSERT_EQ(batch.input_ids.sizes(), (c10::IntArrayRef{2, 40}));
  ASSERT_EQ(batch.labels.sizes(), (c10::IntArrayRef{2, 40}));
  ASSERT_EQ(batch.label_token_weights.sizes(), (c10::IntArrayRef{2, 40}));
  EXPECT_EQ(batch.input_ids.scalar_type(), torch::kInt64);
  EXPECT_EQ(batch.labels.scalar_type(), torch::kInt64);
  EXPECT_EQ(batch.label_token_weights.scalar_type(), torch::kFloat32);
  EXPECT_EQ(batch.tokens(), 80);
  EXPECT_EQ(batch.examples, examples);

  for (int64_t b = 0; b < 2; ++b) {
    std::vector<int64_t> ids, mask;
    expected_sequence(examples[b], ids, mask);
    ASSERT_LT(ids.size(), 41u);
    ids.resize(41, t.pad_id());
    mask.resize(41, 0);
    EXPECT_EQ(row(batch.input_ids, b), std::vector<int64_t>(ids.begin(), ids.end() - 1));
    EXPECT_EQ(row(batch.labels, b), std::vector<int64_t>(ids.begin() + 1, ids.end()));
    EXPECT_EQ(row(batch.label_token_weights, b), std::vector<int64_t>(mask.begin() + 1, mask.end()));
  }
  // The first label with weight 1 is the first target token; <eos_en> is the last weighted label.
  const auto labels = row(batch.labels, 1);
  const auto weights = row(batch.label_token_weights, 1);
  const int64_t first = std::find(weights.begin(), weights.end(), 1) - weights.begin();
  EXPECT_EQ(batch.input_ids[1][first].item<int64_t>(), t.eos_de_id());
  const int64_t last = weights.rend() - std::find(weights.rbegin(), weights.rend(), 1) - 1;
  EXPECT_EQ(labels[last], t.eos_en_id());
  EXPECT_EQ(labels[last + 1], t.pad_id());
}

TEST(CollateTest, TruncatesToModelMaxLengthPlusOne) {
  const Tokenizer& t = tokenizer();
  const TranslationExample example{"am montag sieht der kleine hund den roten ball im park .",
                                   "on monday the small dog sees the red ball in the park ."};
  std::vector<int64_t> ids, mask;
  expected_sequence(example, ids, mask);
  const size_t source_length = std::find(mask.begin(), mask.end(), 1) - mask.begin();
  ASSERT_GT(ids.size(), source_length + 4);
  const int64_t model_max_length = static_cast<int64_t>(source_length) + 2;  // cuts the target
  const Batch batch = collate({example}, t, model_max_length);
  ASSERT_EQ(batch.input_ids.size(1), model_max_length);
  const size_t cut = static_cast<size_t>(model_max_length) + 1;
  EXPECT_EQ(row(batch.input_ids, 0), std::vector<int64_t>(ids.begin(), ids.begin() + cut - 1));
  EXPECT_EQ(row(batch.labels, 0), std::vector<int64_t>(ids.begin() + 1, ids.begin() + cut));
  EXPECT_EQ(row(batch.label_token_weights, 0), std::vector<int64_t>(mask.begin() + 1, mask.begin() + cut));
  EXPECT_EQ(batch.label_token_weights.sum().item<float>(), 3.0f);  // all three target tokens kept

  // Cut inside the source: no target token is left to weigh.
  const Batch source_only = collate({example}, t, 3);
  EXPECT_EQ(source_only.label_token_weights.sum().item<float>(), 0.0f);
  EXPECT_EQ(row(source_only.labels, 0), std::vector<int64_t>(ids.begin() + 1, ids.begin() + 4));
}

TEST(CollateTest, BadArgumentsAreErrors) {
  EXPECT_THROW(collate({}, tokenizer(), 8), std::invalid_argument);
  EXPECT_THROW(collate({{"a .", "b ."}}, tokenizer(), 0), std::invalid_argument);
}

TEST(CollateTest, ToCpuKeepsValues) {
  const Batch batch = collate({{"der hund .", "the dog ."}}, tokenizer(), 8);
  const Batch moved = batch.to(c10::Device(c10::kCPU));
  EXPECT_TRUE(torch::equal(moved.input_ids, batch.input_ids));
  EXPECT_TRUE(torch::equal(moved.label_token_weights, batch.label_token_weights));
  EXPECT_EQ(moved.examples, batch.examples);
}

}  // namespace
}  // namespace harness::data
