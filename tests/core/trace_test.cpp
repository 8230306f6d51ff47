// Tracer: slices from several threads, Chrome JSON with labelled tracks, null tracer.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "harness/trace.h"

namespace harness {
namespace {

TEST(Tracer, RecordsSlicesFromManyThreadsAsChromeJson) {
  Tracer tracer;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&tracer, t] {
      for (int k = 0; k < 25; ++k) {
        TraceScope scope(&tracer, "task", "cpu:" + std::to_string(t % 2),
                         {{"micro_batch", int64_t{k}}, {"kind", std::string("forward")}});
        scope.add_arg("ratio", 0.5);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  ASSERT_EQ(tracer.slices().size(), 100u);

  const auto json = nlohmann::json::parse(tracer.to_chrome_json());
  std::set<int> tids;
  std::set<std::string> labels;
  int complete = 0;
  for (const auto& event : json.at("traceEvents")) {
    if (event.at("ph") == "X") {
      ++complete;
      tids.insert(event.at("tid").get<int>());
      EXPECT_GE(event.at("dur").get<int64_t>(), 0);
      EXPECT_EQ(event.at("args").at("kind"), "forward");
      EXPECT_EQ(event.at("args").at("ratio"), 0.5);
      EXPECT_TRUE(event.at("args").at("micro_batch").is_number_integer());
    } else if (event.at("ph") == "M" && event.at("name") == "thread_name") {
      labels.insert(event.at("args").at("name").get<std::string>());
    }
  }
  EXPECT_EQ(complete, 100);
  EXPECT_EQ(tids.size(), 2u);
  EXPECT_EQ(labels, (std::set<std::string>{"cpu:0", "cpu:1"}));
}

TEST(Tracer, SliceTimesAreOrderedAndValidated) {
  Tracer tracer;
  {
    TraceScope outer(&tracer, "outer", "rank 0");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const auto slices = tracer.slices();
  ASSERT_EQ(slices.size(), 1u);
  EXPECT_EQ(slices[0].track, "rank 0");
  EXPECT_GE(slices[0].end_us - slices[0].start_us, 1500);
  EXPECT_THROW(tracer.record("bad", "rank 0", 10, 5), std::invalid_argument);
}

TEST(Tracer, NullTracerRecordsNothing) {
  Tracer tracer;
  {
    TraceScope ignored(nullptr, "ignored", "cpu:0", {{"x", int64_t{1}}});
    ignored.add_arg("y", 2.0);
    TraceScope kept(&tracer, "kept", "cpu:1");
  }
  const auto slices = tracer.slices();
  ASSERT_EQ(slices.size(), 1u);
  EXPECT_EQ(slices[0].name, "kept");
  EXPECT_EQ(slices[0].track, "cpu:1");
  EXPECT_EQ(tracer.to_chrome_json().find("ignored"), std::string::npos);
}

TEST(Tracer, WritesFileAndNamesPathOnFailure) {
  Tracer tracer;
  tracer.record("step", "cpu:0", 0, 10);
  const std::string path = ::testing::TempDir() + "/harness_trace_test.json";
  tracer.write_chrome_json(path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(nlohmann::json::parse(text.str()).at("traceEvents").size(), 3u);
  std::remove(path.c_str());
  try {
    tracer.write_chrome_json("/nonexistent-dir/trace.json");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/trace.json"), std::string::npos);
  }
}

}  // namespace
}  // namespace harness
