// load_dataset on both layouts (fixture folders) and on broken folders written to a temp dir.
#include "harness/data/dataset.h"

#include <ftw.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace harness::data {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = std::string(HARNESS_FIXTURES_DIR) + "/datasets";

// std::filesystem::remove_all resolves to a copy exported by the wheel's libtorch.so that crashes
// on nested folders, so the temp folders are removed with POSIX nftw.
void remove_tree(const fs::path& path) {
  nftw(
      path.c_str(),
      [](const char* file, const struct stat*, int, struct FTW*) { return ::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("harness_dataset_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    remove_tree(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { remove_tree(path_); }
  const fs::path& path() const { return path_; }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }

 private:
  fs::path path_;
};

// The message of the runtime_error `load_dataset(dir)` throws ("" when it does not throw).
std::string load_error(const fs::path& dir, const SplitSizes& sizes = {}) {
  try {
    load_dataset(dir.string(), sizes);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

void write_valid_jsonl(const TempDir& dir) {
  dir.write("train.jsonl", "{\"de\": \"a .\", \"en\": \"b .\"}\n");
  dir.write("validation.jsonl", "{\"de\": \"c .\", \"en\": \"d .\"}\n");
  dir.write("test.jsonl", "{\"de\": \"e .\", \"en\": \"f .\"}\n");
}

TEST(DatasetTest, LoadsJsonLinesWithAndWithoutTranslationKey) {
  const TranslationCorpus corpus = load_dataset(kFixtures + "/jsonl_small");
  ASSERT_EQ(corpus.train.size(), 4u);
  EXPECT_EQ(corpus.train[0], (TranslationExample{"vielen dank .", "thank you ."}));
  EXPECT_EQ(corpus.train[2], (TranslationExample{"ich weiß es nicht .", "i don 't know ."}));
  EXPECT_EQ(corpus.train[3].de, "die reihenfolge ist egal .");
  ASSERT_EQ(corpus.validation.size(), 2u);
  EXPECT_EQ(corpus.validation[1].en, "how are you ?");
  ASSERT_EQ(corpus.test.size(), 1u);
  EXPECT_EQ(corpus.test[0].de, "tschüss .");
}

TEST(DatasetTest, LoadsFairseqLayoutAlignedByLine) {
  EXPECT_EQ(detect_layout(kFixtures + "/fairseq_small"), DatasetLayout::kFairseq);
  EXPECT_EQ(detect_layout(kFixtures + "/jsonl_small"), DatasetLayout::kJsonLines);
  const TranslationCorpus corpus = load_dataset(kFixtures + "/fairseq_small");
  ASSERT_EQ(corpus.train.size(), 3u);
  EXPECT_EQ(corpus.train[1], (TranslationExample{"das ist gut .", "that is good ."}));
  ASSERT_EQ(corpus.validation.size(), 2u);
  EXPECT_EQ(corpus.validation[0], (TranslationExample{"guten morgen .", "good morning ."}));
  ASSERT_EQ(corpus.test.size(), 1u);
  EXPECT_EQ(corpus.test[0], (TranslationExample{"tschüss .", "bye ."}));
}

TEST(DatasetTest, TakesTheFirstNOfEachSplit) {
  for (const char* layout : {"/jsonl_small", "/fairseq_small"}) {
    const TranslationCorpus corpus = load_dataset(kFixtures + layout, SplitSizes{2, 1, 1});
    ASSERT_EQ(corpus.train.size(), 2u) << layout;
    EXPECT_EQ(corpus.train[1].de, "das ist gut .");
    ASSERT_EQ(corpus.validation.size(), 1u);
    EXPECT_EQ(corpus.validation[0].de, "guten morgen .");
  }
}

TEST(DatasetTest, ExportJsonlRoundTrips) {
  TempDir dir;
  const TranslationCorpus original = load_dataset(kFixtures + "/fairseq_small");
  const fs::path out = dir.path() / "nested" / "export";
  export_jsonl(original, out.string());
  EXPECT_EQ(detect_layout(out.string()), DatasetLayout::kJsonLines);
  const TranslationCorpus back = load_dataset(out.string());
  EXPECT_EQ(back.train, original.train);
  EXPECT_EQ(back.validation, original.validation);
  EXPECT_EQ(back.test, original.test);
  std::ifstream in(out / "train.jsonl");
  std::string first;
  std::getline(in, first);
  EXPECT_EQ(first, "{\"translation\":{\"de\":\"vielen dank .\",\"en\":\"thank you .\"}}");
}

TEST(DatasetTest, NeitherLayoutSaysWhatWasLookedFor) {
  TempDir dir;
  dir.write("readme.txt", "nothing here");
  const std::string message = load_error(dir.path());
  EXPECT_NE(message.find(dir.path().string()), std::string::npos) << message;
  EXPECT_NE(message.find("train.jsonl"), std::string::npos) << message;
  EXPECT_NE(message.find("train.de"), std::string::npos) << message;
  EXPECT_NE(load_error(dir.path() / "does_not_exist").find("no such file"), std::string::npos);
}

TEST(DatasetTest, MissingSplitFileIsNamed) {
  TempDir dir;
  write_valid_jsonl(dir);
  fs::remove(dir.path() / "validation.jsonl");
  const std::string message = load_error(dir.path());
  EXPECT_NE(message.find("validation.jsonl does not exist"), std::string::npos) << message;
}

TEST(DatasetTest, MalformedJsonNamesFileAndLine) {
  TempDir dir;
  write_valid_jsonl(dir);
  dir.write("train.jsonl", "{\"de\": \"a .\", \"en\": \"b .\"}\n\n{\"de\": \"a ., \"en\": \"b .\"}\n");
  const std::string message = load_error(dir.path());
  EXPECT_NE(message.find("train.jsonl:3: malformed JSON"), std::string::npos) << message;
}

TEST(DatasetTest, MissingKeyAndNonStringAreErrors) {
  TempDir dir;
  write_valid_jsonl(dir);
  dir.write("validation.jsonl", "{\"translation\": {\"de\": \"a .\"}}\n");
  std::string message = load_error(dir.path());
  EXPECT_NE(message.find("validation.jsonl:1: missing key \"en\""), std::string::npos) << message;

  dir.write("validation.jsonl", "{\"de\": \"a .\", \"en\": \"b .\"}\n{\"de\": 7, \"en\": \"b .\"}\n");
  message = load_error(dir.path());
  EXPECT_NE(message.find("validation.jsonl:2: \"de\" must be a string"), std::string::npos) << message;

  dir.write("validation.jsonl", "[1, 2]\n");
  message = load_error(dir.path());
  EXPECT_NE(message.find("validation.jsonl:1: expected a JSON object"), std::string::npos) << message;
}

TEST(DatasetTest, EmptySplitIsAnError) {
  TempDir dir;
  write_valid_jsonl(dir);
  dir.write("test.jsonl", "\n");
  const std::string message = load_error(dir.path());
  EXPECT_NE(message.find("test.jsonl holds no examples"), std::string::npos) << message;
  // Asking for no test pairs at all is fine.
  EXPECT_EQ(load_error(dir.path(), SplitSizes{5, 5, 0}), "");
}

TEST(DatasetTest, MisalignedFairseqFilesGiveBothLineCounts) {
  TempDir dir;
  for (const char* split : {"train", "valid", "test"}) {
    dir.write(std::string(split) + ".de", "a .\nb .\n");
    dir.write(std::string(split) + ".en", "c .\nd .\n");
  }
  dir.write("valid.en", "c .\nd .\ne .\n");
  std::string message = load_error(dir.path());
  EXPECT_NE(message.find("misaligned"), std::string::npos) << message;
  EXPECT_NE(message.find("valid.de has 2 lines"), std::string::npos) << message;
  EXPECT_NE(message.find("valid.en has 3"), std::string::npos) << message;

  dir.write("valid.en", "c .\nd .\n");
  fs::remove(dir.path() / "test.en");
  message = load_error(dir.path());
  EXPECT_NE(message.find("test.en does not exist"), std::string::npos) << message;

  dir.write("test.en", "\n\n");
  dir.write("test.de", "x .\n\n");
  message = load_error(dir.path());
  EXPECT_NE(message.find("test.en:1: empty line"), std::string::npos) << message;

  dir.write("test.en", "\n");
  dir.write("test.de", "\n");
  message = load_error(dir.path());
  EXPECT_NE(message.find("test.en hold no sentences (empty split)"), std::string::npos) << message;
}

}  // namespace
}  // namespace harness::data
