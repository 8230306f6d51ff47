// GPT2Config: presets with the published shapes, validation, and Hugging Face's config.json.
#include "harness/model/config.h"

#include "json_depth.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace harness::model {
namespace {

using nlohmann::json;

GPT2Config make(int64_t n_layer, int64_t n_embd, int64_t n_head, int64_t n_positions,
                int64_t vocab_size) {
  GPT2Config c;
  c.n_layer = n_layer;
  c.n_embd = n_embd;
  c.n_head = n_head;
  c.n_positions = n_positions;
  c.vocab_size = vocab_size;
  c.bos_token_id = c.eos_token_id = vocab_size - 1;
  return c;
}

const std::vector<std::pair<std::string, GPT2Config>>& presets() {
  static const std::vector<std::pair<std::string, GPT2Config>> table = {
      {"gpt2", make(12, 768, 12, 1024, 50257)},
      {"gpt2-medium", make(24, 1024, 16, 1024, 50257)},
      {"gpt2-large", make(36, 1280, 20, 1024, 50257)},
      {"gpt2-xl", make(48, 1600, 25, 1024, 50257)},
      {"gpt2-tiny", make(2, 64, 4, 128, 1024)},
      {"gpt2-mini", make(4, 256, 4, 256, 4096)},
  };
  return table;
}

std::string type_name(const json& v) { return v.type_name(); }

// A value for a one-line error message: its type and, for a scalar, its JSON cut after 60 bytes.
// Containers are described by size: dump() would copy a whole (maybe huge) subtree.
std::string shown_with_type(const json& v) {
  if (v.is_object()) return "object with " + std::to_string(v.size()) + " key(s)";
  if (v.is_array()) return "array of " + std::to_string(v.size()) + " element(s)";
  std::string text = v.dump();
  constexpr size_t kShownBytes = 60;
  if (text.size() > kShownBytes) {
    size_t end = kShownBytes;
    while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
    text = text.substr(0, end) + "...";
  }
  return type_name(v) + " " + text;
}

// Reads key into out when present (and not null, which Hugging Face writes for "unset").
void read_int(const json& j, const char* key, int64_t& out, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  if (!it->is_number_integer()) {
    throw std::runtime_error(origin + ": key \"" + key + "\" must be an integer, got " + shown_with_type(*it));
  }
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    throw std::runtime_error(origin + ": key \"" + key + "\" = " + it->dump() +
                             " is out of range (expected at most " + std::to_string(INT64_MAX) + ")");
  }
  out = it->get<int64_t>();
}

void read_double(const json& j, const char* key, double& out, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  if (!it->is_number()) {
    throw std::runtime_error(origin + ": key \"" + key + "\" must be a number, got " + shown_with_type(*it));
  }
  out = it->get<double>();
}

// Options of GPT2Config this implementation does not have: accepted only at their defaults.
void require_value(const json& j, const char* key, const json& expected, const std::string& origin,
                   const std::vector<json>& also_ok = {}) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  if (*it == expected) return;
  for (const auto& ok : also_ok) {
    if (*it == ok) return;
  }
  throw std::runtime_error(origin + ": key \"" + key + "\" = " + shown_with_type(*it) +
                           " is not supported (expected " + shown_with_type(expected) + ")");
}

}  // namespace

void GPT2Config::validate() const {
  // Far above any real model, and low enough that inner_dim() (4 * n_embd) and the products of
  // two sizes (a weight's element count) cannot overflow int64.
  constexpr int64_t kMaxSize = INT32_MAX;
  auto at_most = [&](const char* name, int64_t v) {
    if (v > kMaxSize) {
      throw std::invalid_argument(std::string("GPT2Config: ") + name + " must be at most " +
                                  std::to_string(kMaxSize) + ", got " + std::to_string(v));
    }
  };
  auto positive = [&](const char* name, int64_t v) {
    if (v <= 0) {
      throw std::invalid_argument(std::string("GPT2Config: ") + name + " must be positive, got " +
                                  std::to_string(v));
    }
    at_most(name, v);
  };
  positive("vocab_size", vocab_size);
  positive("n_positions", n_positions);
  positive("n_embd", n_embd);
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  if (n_inner < 0) {
    throw std::invalid_argument("GPT2Config: n_inner must be >= 0 (0 = 4 * n_embd), got " +
                                std::to_string(n_inner));
  }
  at_most("n_inner", n_inner);
  if (n_embd % n_head != 0) {
    throw std::invalid_argument("GPT2Config: n_embd " + std::to_string(n_embd) +
                                " is not divisible by n_head " + std::to_string(n_head));
  }
  auto probability = [](const char* name, double p) {
    if (!(p >= 0.0 && p < 1.0)) {
      throw std::invalid_argument(std::string("GPT2Config: ") + name + " must be in [0, 1), got " +
                                  std::to_string(p));
    }
  };
  probability("embd_pdrop", embd_pdrop);
  probability("attn_pdrop", attn_pdrop);
  probability("resid_pdrop", resid_pdrop);
  if (!(layer_norm_epsilon > 0.0)) {
    throw std::invalid_argument("GPT2Config: layer_norm_epsilon must be positive, got " +
                                std::to_string(layer_norm_epsilon));
  }
}

GPT2Config GPT2Config::preset(const std::string& name) {
  for (const auto& [preset_name, config] : presets()) {
    if (preset_name == name) return config;
  }
  std::string valid;
  for (const auto& n : preset_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown model preset '" + name + "'; valid names: " + valid);
}

std::vector<std::string> GPT2Config::preset_names() {
  std::vector<std::string> names;
  for (const auto& entry : presets()) names.push_back(entry.first);
  return names;
}

GPT2Config GPT2Config::from_json_string(const std::string& text, const std::string& origin) {
  detail::check_json_nesting(text.data(), text.size(), 64, origin);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    throw std::runtime_error(origin + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) {
    throw std::runtime_error(origin + ": expected a JSON object, got " + shown_with_type(j));
  }
  if (auto it = j.find("model_type"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) {
      throw std::runtime_error(origin + ": key \"model_type\" must be a string, got " + shown_with_type(*it));
    }
    if (it->get<std::string>() != "gpt2") {
      throw std::runtime_error(origin + ": key \"model_type\" is " + shown_with_type(*it) +
                               ", only \"gpt2\" is supported");
    }
  }
  GPT2Config c;
  read_int(j, "vocab_size", c.vocab_size, origin);
  read_int(j, "n_positions", c.n_positions, origin);
  read_int(j, "n_embd", c.n_embd, origin);
  read_int(j, "n_layer", c.n_layer, origin);
  read_int(j, "n_head", c.n_head, origin);
  read_int(j, "n_inner", c.n_inner, origin);
  read_double(j, "layer_norm_epsilon", c.layer_norm_epsilon, origin);
  read_double(j, "embd_pdrop", c.embd_pdrop, origin);
  read_double(j, "attn_pdrop", c.attn_pdrop, origin);
  read_double(j, "resid_pdrop", c.resid_pdrop, origin);
  read_double(j, "initializer_range", c.initializer_range, origin);
  read_int(j, "bos_token_id", c.bos_token_id, origin);
  read_int(j, "eos_token_id", c.eos_token_id, origin);
  require_value(j, "activation_function", "gelu_new", origin, {"gelu_pytorch_tanh"});
  require_value(j, "scale_attn_weights", true, origin);
  require_value(j, "scale_attn_by_inverse_layer_idx", false, origin);
  require_value(j, "reorder_and_upcast_attn", false, origin);
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(origin + ": " + e.what());
  }
  return c;
}

GPT2Config GPT2Config::from_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open config file");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return from_json_string(buffer.str(), path);
}

std::string GPT2Config::to_json_string() const {
  json j;
  j["activation_function"] = "gelu_new";
  j["architectures"] = json::array({"GPT2LMHeadModel"});
  j["attn_pdrop"] = attn_pdrop;
  j["bos_token_id"] = bos_token_id;
  j["embd_pdrop"] = embd_pdrop;
  j["eos_token_id"] = eos_token_id;
  j["initializer_range"] = initializer_range;
  j["layer_norm_epsilon"] = layer_norm_epsilon;
  j["model_type"] = "gpt2";
  j["n_ctx"] = n_positions;
  j["n_embd"] = n_embd;
  j["n_head"] = n_head;
  j["n_inner"] = n_inner > 0 ? json(n_inner) : json(nullptr);
  j["n_layer"] = n_layer;
  j["n_positions"] = n_positions;
  j["reorder_and_upcast_attn"] = false;
  j["resid_pdrop"] = resid_pdrop;
  j["scale_attn_by_inverse_layer_idx"] = false;
  j["scale_attn_weights"] = true;
  j["tie_word_embeddings"] = true;
  j["torch_dtype"] = "float32";
  j["use_cache"] = true;
  j["vocab_size"] = vocab_size;
  return j.dump(2) + "\n";
}

void GPT2Config::save_json_file(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error(path + ": cannot open for writing");
  out << to_json_string();
  if (!out) throw std::runtime_error(path + ": write failed");
}

}  // namespace harness::model
