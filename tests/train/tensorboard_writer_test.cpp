// TensorBoard event files: CRC-32C against its published check value, and a written file read
// back record by record (lengths, both masked CRCs, the Event fields of each scalar).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "harness/train/run/tensorboard_writer.h"

namespace harness::train {
namespace {

TEST(TensorBoardWriter, Crc32cHasTheCastagnoliCheckValueAndTFRecordsMask) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // RFC 3720's check value of CRC-32C
  EXPECT_EQ(crc32c("", 0), 0u);
  const uint32_t crc = crc32c("abc", 3);
  EXPECT_EQ(masked_crc32c("abc", 3), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

template <typename T>
T read_le(const std::string& bytes, size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof(T));
  return value;
}

TEST(TensorBoardWriter, WritesFramedRecordsOfScalarEvents) {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/tensorboard_writer_test_" +
                          std::to_string(::getpid());
  std::string path;
  {
    TensorBoardWriter writer(dir, /*resumed_step=*/4);
    writer.add_scalar("train/loss", 2.5, 5);
    writer.add_scalar("eval/validation_loss", 0.125, 6);
    path = writer.path();
  }
  EXPECT_NE(path.find("events.out.tfevents."), std::string::npos);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream all;
  all << in.rdbuf();
  const std::string bytes = all.str();
  std::vector<std::string> events;
  for (size_t at = 0; at < bytes.size();) {
    ASSERT_LE(at + 12, bytes.size());
    const uint64_t length = read_le<uint64_t>(bytes, at);
    EXPECT_EQ(read_le<uint32_t>(bytes, at + 8), masked_crc32c(bytes.data() + at, 8));
    ASSERT_LE(at + 12 + length + 4, bytes.size());
    const std::string event = bytes.substr(at + 12, length);
    EXPECT_EQ(read_le<uint32_t>(bytes, at + 12 + length), masked_crc32c(event.data(), event.size()));
    events.push_back(event);
    at += 12 + length + 4;
  }
  ASSERT_EQ(events.size(), 4u);  // the file version, the session start, two scalars
  EXPECT_NE(events[0].find("brain.Event:2"), std::string::npos);
  // Each event: wall_time (field 1, fixed64), step (field 2, varint), then its payload.
  EXPECT_EQ(events[1][0], 0x09);
  EXPECT_EQ(events[1][9], 0x10);
  EXPECT_EQ(events[1][10], 5);  // the step after the resumed one
  EXPECT_EQ(events[1].substr(11), std::string("\x32\x02\x08\x01", 4));  // session_log { status: START }
  EXPECT_EQ(events[2][10], 5);
  const std::string& scalar = events[2];
  // summary (field 5) { value (1) { tag (1) "train/loss", simple_value (2, fixed32) 2.5f } }
  const std::string tag = "train/loss";
  ASSERT_EQ(scalar[11], 0x2a);
  const size_t value_at = 13;
  ASSERT_EQ(scalar[value_at], 0x0a);
  ASSERT_EQ(scalar[value_at + 2], 0x0a);
  EXPECT_EQ(scalar.substr(value_at + 4, tag.size()), tag);
  ASSERT_EQ(scalar[value_at + 4 + tag.size()], 0x15);
  EXPECT_EQ(read_le<float>(scalar, value_at + 5 + tag.size()), 2.5f);
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST(TensorBoardWriter, AFolderThatCannotBeCreatedIsAnErrorNamingTheFlag) {
  try {
    TensorBoardWriter writer("/proc/no/such/folder");
    FAIL() << "wrote into /proc";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--tensorboard_dir /proc/no/such/folder"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace harness::train
