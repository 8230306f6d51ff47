// GPT2Config: presets, validation, and Hugging Face config.json reading and writing.
#include "harness/model/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace harness::model {
namespace {

const std::string kFixture = std::string(HARNESS_FIXTURES_DIR) + "/gpt2_tiny";

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(GPT2ConfigTest, PresetsHaveThePublishedShapes) {
  struct Row { const char* name; int64_t layers, embd, heads, positions, vocab; };
  const Row rows[] = {{"gpt2", 12, 768, 12, 1024, 50257},      {"gpt2-medium", 24, 1024, 16, 1024, 50257},
                      {"gpt2-large", 36, 1280, 20, 1024, 50257}, {"gpt2-xl", 48, 1600, 25, 1024, 50257},
                      {"gpt2-tiny", 2, 64, 4, 128, 1024},        {"gpt2-mini", 4, 256, 4, 256, 4096}};
  for (const auto& r : rows) {
    SCOPED_TRACE(r.name);
    const auto c = GPT2Config::preset(r.name);
    EXPECT_EQ(c.n_layer, r.layers);
    EXPECT_EQ(c.n_embd, r.embd);
    EXPECT_EQ(c.n_head, r.heads);
    EXPECT_EQ(c.n_positions, r.positions);
    EXPECT_EQ(c.vocab_size, r.vocab);
    EXPECT_EQ(c.inner_dim(), 4 * r.embd);
    EXPECT_NO_THROW(c.validate());
  }
  EXPECT_EQ(GPT2Config::preset_names().size(), 6u);
}

TEST(GPT2ConfigTest, UnknownPresetListsTheValidNames) {
  const std::string msg = error_of([] { GPT2Config::preset("gpt3"); });
  EXPECT_NE(msg.find("gpt3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gpt2-medium"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gpt2-mini"), std::string::npos) << msg;
}

TEST(GPT2ConfigTest, ValidateNamesTheOffendingValues) {
  auto c = GPT2Config::preset("gpt2-tiny");
  c.n_head = 5;
  const std::string msg = error_of([&] { c.validate(); });
  EXPECT_NE(msg.find("64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("5"), std::string::npos) << msg;
  c = GPT2Config::preset("gpt2-tiny");
  c.n_layer = 0;
  EXPECT_THROW(c.validate(), std::invalid_argument);
}

TEST(GPT2ConfigTest, ReadsTheConfigThatTransformersWrote) {
  const auto c = GPT2Config::from_json_file(kFixture + "/config.json");
  EXPECT_EQ(c.vocab_size, 97);
  EXPECT_EQ(c.n_positions, 32);
  EXPECT_EQ(c.n_embd, 32);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.n_inner, 0);  // "n_inner": null
  EXPECT_EQ(c.embd_pdrop, 0.0);
  EXPECT_EQ(c.bos_token_id, 96);
}

TEST(GPT2ConfigTest, JsonRoundTripKeepsEveryField) {
  auto c = GPT2Config::preset("gpt2-mini");
  c.n_inner = 300;
  c.layer_norm_epsilon = 1e-6;
  c.attn_pdrop = 0.25;
  c.eos_token_id = 7;
  const std::string text = c.to_json_string();
  for (const char* key : {"\"model_type\": \"gpt2\"", "\"GPT2LMHeadModel\"", "\"gelu_new\"", "\"n_ctx\": 256"}) {
    EXPECT_NE(text.find(key), std::string::npos) << key << " missing from\n" << text;
  }
  const auto back = GPT2Config::from_json_string(text);
  EXPECT_EQ(back.vocab_size, c.vocab_size);
  EXPECT_EQ(back.n_positions, c.n_positions);
  EXPECT_EQ(back.n_embd, c.n_embd);
  EXPECT_EQ(back.n_layer, c.n_layer);
  EXPECT_EQ(back.n_head, c.n_head);
  EXPECT_EQ(back.n_inner, 300);
  EXPECT_EQ(back.layer_norm_epsilon, 1e-6);
  EXPECT_EQ(back.attn_pdrop, 0.25);
  EXPECT_EQ(back.embd_pdrop, c.embd_pdrop);
  EXPECT_EQ(back.resid_pdrop, c.resid_pdrop);
  EXPECT_EQ(back.initializer_range, c.initializer_range);
  EXPECT_EQ(back.eos_token_id, 7);

  const auto path = std::filesystem::temp_directory_path() / "harness_config_test.json";
  c.save_json_file(path.string());
  EXPECT_EQ(GPT2Config::from_json_file(path.string()).n_inner, 300);
  std::filesystem::remove(path);
}

TEST(GPT2ConfigTest, ExtraKeysAreIgnored) {
  const auto c = GPT2Config::from_json_string(
      R"({"n_layer": 3, "n_embd": 48, "n_head": 3, "summary_type": "cls_index", "task_specific_params": {"a": 1}})");
  EXPECT_EQ(c.n_layer, 3);
  EXPECT_EQ(c.n_embd, 48);
}

TEST(GPT2ConfigTest, WrongTypesNameTheFileAndKey) {
  std::string msg = error_of([] { GPT2Config::from_json_string(R"({"n_layer": "12"})", "my/config.json"); });
  EXPECT_NE(msg.find("my/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("n_layer"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(R"({"attn_pdrop": true})", "c.json"); });
  EXPECT_NE(msg.find("attn_pdrop"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(R"({"n_embd": 1.5})", "c.json"); });
  EXPECT_NE(msg.find("n_embd"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string("[1, 2]", "c.json"); });
  EXPECT_NE(msg.find("object"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string("{\"n_layer\": ", "c.json"); });
  EXPECT_NE(msg.find("JSON"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(R"({"activation_function": "relu"})", "c.json"); });
  EXPECT_NE(msg.find("activation_function"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(R"({"model_type": "llama"})", "c.json"); });
  EXPECT_NE(msg.find("model_type"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(R"({"n_embd": 100, "n_head": 12})", "c.json"); });
  EXPECT_NE(msg.find("c.json"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(std::string(100000, '[') + std::string(100000, ']'), "deep.json"); });
  EXPECT_NE(msg.find("deep.json: JSON nests"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_file("/nonexistent/config.json"); });
  EXPECT_NE(msg.find("/nonexistent/config.json"), std::string::npos) << msg;
}

// Defect: a number too large for a double is nlohmann's out_of_range, not a parse_error; it escaped
// from from_json_string as a json exception that named neither the file nor the key.
TEST(GPT2ConfigTest, NumberOverflowIsARuntimeErrorNamingTheFile) {
  try {
    GPT2Config::from_json_string(R"({"n_layer": 2, "layer_norm_epsilon": 1e999})", "big/config.json");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("big/config.json: not valid JSON"), std::string::npos) << e.what();
  }
}

// Defect: sizes were only checked to be positive, so n_embd = 2^62 passed and inner_dim()
// (4 * n_embd) overflowed (found by fuzz_config under UBSan); integers above INT64_MAX wrapped
// to negative ids silently.
TEST(GPT2ConfigTest, HugeValuesAreRejected) {
  std::string msg = error_of([] { GPT2Config::from_json_string(R"({"n_embd": 4611686018427387904, "n_head": 1})", "c.json"); });
  EXPECT_NE(msg.find("c.json: GPT2Config: n_embd must be at most 2147483647, got 4611686018427387904"),
            std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(R"({"n_inner": 4294967296})", "c.json"); });
  EXPECT_NE(msg.find("n_inner must be at most"), std::string::npos) << msg;
  msg = error_of([] { GPT2Config::from_json_string(R"({"bos_token_id": 18446744073709551615})", "c.json"); });
  EXPECT_NE(msg.find("c.json: key \"bos_token_id\" = 18446744073709551615 is out of range"), std::string::npos) << msg;
  EXPECT_NO_THROW(GPT2Config::from_json_string(R"({"n_embd": 2048, "n_head": 16, "n_inner": 8192})"));
}

// Messages describe a container value instead of copying it: one short line.
TEST(GPT2ConfigTest, ErrorsAreOneShortLine) {
  std::string big = "[0";
  for (int i = 1; i < 10000; ++i) big += "," + std::to_string(i);
  big += "]";
  for (const std::string key : {"n_layer", "attn_pdrop", "activation_function", "model_type"}) {
    const std::string msg = error_of([&] { GPT2Config::from_json_string("{\"" + key + "\": " + big + "}", "c.json"); });
    EXPECT_NE(msg.find("c.json: key \"" + key + "\""), std::string::npos) << msg.substr(0, 300);
    EXPECT_NE(msg.find("array of 10000 element(s)"), std::string::npos) << msg.substr(0, 300);
    EXPECT_LT(msg.size(), 200u) << msg.substr(0, 300);
  }
}

}  // namespace
}  // namespace harness::model
