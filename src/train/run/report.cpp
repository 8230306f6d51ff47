// Number formatting, mean/std and the JSON files of SPEC §7.
#include "harness/train/run/report.h"

#include <nlohmann/json.hpp>

#include <charconv>
#include <cmath>
#include <fstream>
#include <stdexcept>

namespace harness::train {

std::string format_number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[512];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::fixed);
  if (ec != std::errc()) throw std::runtime_error("format_number: cannot format value");
  return std::string(buffer, end);
}

MeanStd mean_std(const std::vector<double>& values) {
  MeanStd out;
  if (values.empty()) return out;
  double sum = 0.0;
  for (double v : values) sum += v;
  out.mean = sum / static_cast<double>(values.size());
  double squares = 0.0;
  for (double v : values) squares += (v - out.mean) * (v - out.mean);
  out.std = std::sqrt(squares / static_cast<double>(values.size()));
  return out;
}

namespace {
void write_json(const std::string& path, const nlohmann::json& json) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << json.dump(2) << "\n";
  if (!out) throw std::runtime_error("error while writing " + path);
}
}  // namespace

void write_results_json(const std::string& path, const EpochResults& results) {
  write_json(path, {{"validation_loss", results.validation_loss},
                    {"bleu", results.bleu},
                    {"training_time", results.training_time},
                    {"tokens_per_sec", results.tokens_per_sec}});
}

void write_generations_json(const std::string& path,
                            const std::vector<data::TranslationExample>& examples,
                            const std::vector<std::string>& generations) {
  if (examples.size() != generations.size()) {
    throw std::invalid_argument("write_generations_json: " + std::to_string(examples.size()) +
                                " examples but " + std::to_string(generations.size()) +
                                " generations");
  }
  nlohmann::json list = nlohmann::json::array();
  for (size_t i = 0; i < examples.size(); ++i) {
    list.push_back({{"example", {{"de", examples[i].de}, {"en", examples[i].en}}},
                    {"gen", generations[i]}});
  }
  write_json(path, list);
}

}  // namespace harness::train
