// GPT-2's hyper-parameters as Hugging Face's GPT2Config names them, with the published presets
// and reading/writing of config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace harness::model {

struct GPT2Config {
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;
  int64_t n_embd = 768;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_inner = 0;  // 0 means 4 * n_embd, as in Hugging Face
  double layer_norm_epsilon = 1e-5;
  double embd_pdrop = 0.1;
  double attn_pdrop = 0.1;
  double resid_pdrop = 0.1;
  double initializer_range = 0.02;
  int64_t bos_token_id = 50256;
  int64_t eos_token_id = 50256;

  int64_t inner_dim() const { return n_inner > 0 ? n_inner : 4 * n_embd; }
  int64_t head_dim() const { return n_embd / n_head; }

  // Throws std::invalid_argument with the offending values (n_embd % n_head, non-positive sizes...).
  void validate() const;

  // "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-tiny", "gpt2-mini".
  static GPT2Config preset(const std::string& name);
  static std::vector<std::string> preset_names();

  // Hugging Face config.json. Unknown keys are ignored; a wrong type or a missing file is an
  // error naming the file and the key.
  static GPT2Config from_json_file(const std::string& path);
  static GPT2Config from_json_string(const std::string& text, const std::string& origin = "<string>");
  std::string to_json_string() const;  // loadable by transformers' GPT2Config
  void save_json_file(const std::string& path) const;
};

}  // namespace harness::model
