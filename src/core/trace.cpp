// Chrome trace JSON for harness::Tracer.
#include "harness/trace.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <stdexcept>

namespace harness {

Tracer::Tracer() : origin_(std::chrono::steady_clock::now()) {}

int64_t Tracer::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               origin_)
      .count();
}

void Tracer::record(std::string name, std::string track, int64_t start_us, int64_t end_us,
                    Args args) {
  if (end_us < start_us) {
    throw std::invalid_argument("trace slice '" + name + "' on track '" + track + "' ends at " +
                                std::to_string(end_us) + " us, before its start " +
                                std::to_string(start_us) + " us");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  slices_.push_back({std::move(name), std::move(track), start_us, end_us, std::move(args)});
}

std::vector<Tracer::Slice> Tracer::slices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slices_;
}

std::string Tracer::to_chrome_json() const {
  constexpr int kPid = 1;
  const std::vector<Slice> all = slices();
  std::map<std::string, int> tids;
  nlohmann::json events = nlohmann::json::array();
  for (const Slice& slice : all) {
    auto [it, added] = tids.emplace(slice.track, static_cast<int>(tids.size()) + 1);
    if (added) {
      events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", kPid}, {"tid", it->second},
                        {"args", {{"name", slice.track}}}});
      events.push_back({{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", kPid},
                        {"tid", it->second}, {"args", {{"sort_index", it->second}}}});
    }
    nlohmann::json args = nlohmann::json::object();
    for (const auto& [key, value] : slice.args) {
      std::visit([&args, &key = key](const auto& v) { args[key] = v; }, value);
    }
    events.push_back({{"ph", "X"}, {"name", slice.name}, {"pid", kPid}, {"tid", it->second},
                      {"ts", slice.start_us}, {"dur", slice.end_us - slice.start_us},
                      {"args", std::move(args)}});
  }
  return nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

void Tracer::write_chrome_json(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("--trace " + path + ": cannot open the file for writing");
  out << to_chrome_json();
  out.close();
  if (!out) throw std::runtime_error("--trace " + path + ": writing the trace failed");
}

TraceScope::TraceScope(Tracer* tracer, std::string name, std::string track, Tracer::Args args)
    : tracer_(tracer) {
  if (tracer_ == nullptr) return;
  name_ = std::move(name);
  track_ = std::move(track);
  args_ = std::move(args);
  start_us_ = tracer_->now_us();
}

TraceScope::~TraceScope() {
  if (tracer_ == nullptr) return;
  try {
    tracer_->record(std::move(name_), std::move(track_), start_us_, tracer_->now_us(),
                    std::move(args_));
  } catch (...) {
    // A destructor must not throw; a lost slice is harmless.
  }
}

void TraceScope::add_arg(std::string key, Tracer::ArgValue value) {
  if (tracer_ != nullptr) args_.emplace_back(std::move(key), std::move(value));
}

}  // namespace harness
