// load_dataset on both layouts (fixture folders) and on broken folders written to a temp dir.
#include "harness/data/dataset.h"

#include <ftw.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

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

// Defect: JSON Lines had no nesting limit (config.json has one): nlohmann::json copies and dumps
// recursively, so a deep enough line overflowed the stack; a moderately deep one was accepted.
TEST(DatasetTest, JsonLinesNestingIsLimited) {
  TempDir dir;
  write_valid_jsonl(dir);
  const std::string deep_column = std::string(100, '[') + std::string(100, ']');
  dir.write("train.jsonl", "{\"de\": \"a .\", \"en\": \"b .\"}\n{\"de\": \"a\", \"en\": \"b\", \"x\": " +
                               deep_column + "}\n");
  std::string message = load_error(dir.path());
  EXPECT_NE(message.find("train.jsonl:2: JSON nests more than 64 levels"), std::string::npos) << message;

  // Deep enough to overflow the stack when the error message serialised the value.
  const std::string very_deep = std::string(200000, '[') + std::string(200000, ']');
  dir.write("train.jsonl", "{\"de\": " + very_deep + ", \"en\": \"b\"}\n");
  message = load_error(dir.path());
  EXPECT_NE(message.find("train.jsonl:1: JSON nests more than 64 levels"), std::string::npos)
      << message.substr(0, 200);
}

// Defect: the messages serialised the offending value with dump(), which recurses and copies a
// whole subtree into the message. Now each message is one short line.
TEST(DatasetTest, ErrorMessagesAreOneShortLine) {
  TempDir dir;
  write_valid_jsonl(dir);
  std::string big_array = "[0";
  for (int i = 1; i < 10000; ++i) big_array += "," + std::to_string(i);
  big_array += "]";
  const std::string cases[][2] = {
      {"{\"de\": " + big_array + ", \"en\": \"b\"}\n", "train.jsonl:1: \"de\" must be a string, got an array of 10000 element(s)"},
      {"{\"translation\": {\"de\": \"a\", \"x\": " + big_array + "}}\n", "train.jsonl:1: missing key \"en\" (the object has keys \"de\", \"x\")"},
      {"{\"translation\": {\"de\": \"a\", \"line\\nbreak\": 1}}\n", "missing key \"en\" (the object has keys \"de\", \"line\\u000abreak\")"},
      {"{\"translation\": " + big_array + "}\n", "\"translation\" must be an object, got an array of 10000 element(s)"},
      {"{\"de\": 7, \"en\": \"b\"}\n", "\"de\" must be a string, got the number 7"},
  };
  for (const auto& [text, expected] : cases) {
    dir.write("train.jsonl", text);
    const std::string message = load_error(dir.path());
    EXPECT_NE(message.find(expected), std::string::npos) << message.substr(0, 300);
    EXPECT_LT(message.size(), 300u) << message.substr(0, 300);
    EXPECT_EQ(message.find('\n'), std::string::npos) << message.substr(0, 300);
  }
}

// A number too large for a double is nlohmann's out_of_range, not a parse_error: it escaped as an
// exception that named neither the file nor the line.
TEST(DatasetTest, NumberOverflowIsAMalformedLine) {
  TempDir dir;
  write_valid_jsonl(dir);
  dir.write("validation.jsonl", "{\"de\": \"a\", \"en\": \"b\", \"score\": 1e999}\n");
  const std::string message = load_error(dir.path());
  EXPECT_NE(message.find("validation.jsonl:1: malformed JSON"), std::string::npos) << message;
}

TEST(DatasetTest, JsonLinesWithByteOrderMarkAndCrlfLoad) {
  TempDir dir;
  write_valid_jsonl(dir);
  const std::string bom = "\xEF\xBB\xBF";
  dir.write("train.jsonl", bom + "{\"de\": \"gr\xC3\xBC\xC3\x9F" "e .\", \"en\": \"hello .\"}\r\n\r\n" +
                               "{\"translation\": {\"de\": \"b .\", \"en\": \"c .\"}}\r\n");
  dir.write("validation.jsonl", bom + "\r\n{\"de\": \"d .\", \"en\": \"e .\"}\r\n");  // the mark on a blank line
  dir.write("test.jsonl", bom + "{\"de\": \"f .\", \"en\": \"g .\"}");  // no line end at all
  const TranslationCorpus corpus = load_dataset(dir.path().string());
  ASSERT_EQ(corpus.train.size(), 2u);
  EXPECT_EQ(corpus.train[0], (TranslationExample{"gr\xC3\xBC\xC3\x9F" "e .", "hello ."}));
  EXPECT_EQ(corpus.train[1], (TranslationExample{"b .", "c ."}));
  ASSERT_EQ(corpus.validation.size(), 1u);
  EXPECT_EQ(corpus.validation[0], (TranslationExample{"d .", "e ."}));
  ASSERT_EQ(corpus.test.size(), 1u);
  EXPECT_EQ(corpus.test[0], (TranslationExample{"f .", "g ."}));
}

TEST(DatasetTest, FairseqWithByteOrderMarkAndCrlfLoads) {
  TempDir dir;
  const std::string bom = "\xEF\xBB\xBF";
  for (const char* split : {"train", "valid", "test"}) {
    dir.write(std::string(split) + ".de", bom + "guten morgen .\r\ndanke .\r\n");
    dir.write(std::string(split) + ".en", bom + "good morning .\r\nthanks .\r\r\n");  // CRLF twice
  }
  const TranslationCorpus corpus = load_dataset(dir.path().string());
  for (const auto* split : {&corpus.train, &corpus.validation, &corpus.test}) {
    ASSERT_EQ(split->size(), 2u);
    EXPECT_EQ((*split)[0], (TranslationExample{"guten morgen .", "good morning ."}));
    EXPECT_EQ((*split)[1], (TranslationExample{"danke .", "thanks ."}));
  }
}

// export_jsonl (run by both programs on the loaded corpus) cannot write text that is not UTF-8:
// the fairseq reader refuses it with the file, the line and the byte, not json's type_error later.
TEST(DatasetTest, FairseqTextThatIsNotUtf8IsNamed) {
  TempDir dir;
  for (const char* split : {"train", "valid", "test"}) {
    dir.write(std::string(split) + ".de", "a .\nb .\n");
    dir.write(std::string(split) + ".en", "c .\nd .\n");
  }
  dir.write("valid.de", "a .\ngr\xFC\xDF" "e .\n");  // Latin-1
  std::string message = load_error(dir.path());
  EXPECT_NE(message.find("valid.de:2: not UTF-8 text (invalid byte 0xfc at column 3)"), std::string::npos)
      << message;
  dir.write("valid.de", "a .\n\xED\xA0\x80 .\n");  // a surrogate, which JSON cannot hold either
  message = load_error(dir.path());
  EXPECT_NE(message.find("valid.de:2: not UTF-8 text (invalid byte 0xed at column 1)"), std::string::npos)
      << message;

  dir.write("valid.de", "a .\n\xE2\x82\xAC \xF0\x9F\x98\x80 .\n");  // valid three- and four-byte forms
  const TranslationCorpus corpus = load_dataset(dir.path().string());
  EXPECT_NO_THROW(export_jsonl(corpus, (dir.path() / "exported").string()));
}

TEST(DatasetTest, StreamReadersNameTheirOrigin) {
  std::istringstream jsonl("{\"de\": \"a\"}\n");
  try {
    read_jsonl_split(jsonl, "memory.jsonl", 10);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("memory.jsonl:1: missing key \"en\""), std::string::npos) << e.what();
  }
  std::istringstream de("a\nb\n"), en("c\nd\n");
  const auto pairs = read_fairseq_split(de, "m.de", en, "m.en", 1);
  ASSERT_EQ(pairs.size(), 1u);
  EXPECT_EQ(pairs[0], (TranslationExample{"a", "c"}));
}

}  // namespace
}  // namespace harness::data
