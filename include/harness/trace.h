// A timeline of what ran where: complete slices (name, track such as "cpu:0" or "rank 1",
// start/end, arguments) written as Chrome trace JSON (chrome://tracing, Perfetto). Tracing is off
// when the Tracer pointer is null; TraceScope then costs one branch.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace harness {

class Tracer {
 public:
  using ArgValue = std::variant<std::string, int64_t, double>;
  using Args = std::vector<std::pair<std::string, ArgValue>>;

  struct Slice {
    std::string name;
    std::string track;
    int64_t start_us = 0;  // microseconds since the tracer was created
    int64_t end_us = 0;
    Args args;
  };

  Tracer();

  // Microseconds since construction (steady clock).
  int64_t now_us() const;

  // Thread-safe. Throws std::invalid_argument when end_us < start_us.
  void record(std::string name, std::string track, int64_t start_us, int64_t end_us, Args args = {});

  // A copy of every slice recorded so far, in recording order.
  std::vector<Slice> slices() const;

  // {"traceEvents": [...], "displayTimeUnit": "ms"}: one "X" event per slice, one pid for the
  // process, one tid per track (in order of first use) and a "thread_name" metadata event per
  // track so the viewer labels it.
  std::string to_chrome_json() const;
  // Writes to_chrome_json() to `path`; throws std::runtime_error naming the path on failure.
  void write_chrome_json(const std::string& path) const;

 private:
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<Slice> slices_;
};

// Records one slice covering its own lifetime; does nothing when `tracer` is null.
class TraceScope {
 public:
  TraceScope(Tracer* tracer, std::string name, std::string track, Tracer::Args args = {});
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

  void add_arg(std::string key, Tracer::ArgValue value);

 private:
  Tracer* tracer_;
  std::string name_, track_;
  Tracer::Args args_;
  int64_t start_us_ = 0;
};

}  // namespace harness
