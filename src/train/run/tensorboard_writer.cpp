// TensorBoard event files (see tensorboard_writer.h).
#include "harness/train/run/tensorboard_writer.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "harness/train/setup.h"

namespace harness::train {
namespace {

std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));  // reflected Castagnoli
    table[i] = crc;
  }
  return table;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Protocol-buffer wire format, the pieces an Event with a scalar summary needs.
void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

template <typename T>
void put_little_endian(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // x86-64 and aarch64 Linux are little-endian
  out.append(bytes, sizeof(T));
}

void put_tag(std::string& out, int field, int wire_type) { put_varint(out, static_cast<uint64_t>(field << 3 | wire_type)); }

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event { double wall_time = 1; int64 step = 2; oneof { string file_version = 3; Summary summary = 5;
// SessionLog session_log = 6; } }
std::string event_header(int64_t step) {
  std::string event;
  put_tag(event, 1, 1);
  put_little_endian<double>(event, unix_seconds());
  put_tag(event, 2, 0);
  put_varint(event, static_cast<uint64_t>(step));
  return event;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = crc32c_table();
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ bytes[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t resumed_step) {
  try {
    make_directories(dir);
  } catch (const std::exception& e) {
    throw std::invalid_argument("--tensorboard_dir " + dir + ": " + e.what());
  }
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(unix_seconds())) + "." + host + "." +
          std::to_string(::getpid());
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) {
    throw std::invalid_argument("--tensorboard_dir " + dir + ": cannot write " + path_ + ": " + std::strerror(errno));
  }
  std::string version = event_header(0);
  put_bytes(version, 3, "brain.Event:2");
  write_event(version);
  if (resumed_step >= 0) {
    // SessionLog { SessionStatus status = 1; } with START (1): TensorBoard purges the points at
    // and after this event's step that earlier files hold.
    std::string session;
    put_tag(session, 1, 0);
    put_varint(session, 1);
    std::string start = event_header(resumed_step + 1);
    put_bytes(start, 6, session);
    write_event(start);
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  // Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
  std::string summary_value;
  put_bytes(summary_value, 1, tag);
  put_tag(summary_value, 2, 5);
  put_little_endian<float>(summary_value, static_cast<float>(value));
  std::string summary;
  put_bytes(summary, 1, summary_value);
  std::string event = event_header(step);
  put_bytes(event, 5, summary);
  write_event(event);
}

void TensorBoardWriter::write_event(const std::string& event) {
  // TFRecord: uint64 length, uint32 masked CRC of the length's bytes, the data, uint32 masked CRC of it.
  std::string record;
  put_little_endian<uint64_t>(record, event.size());
  put_little_endian<uint32_t>(record, masked_crc32c(record.data(), 8));
  record += event;
  put_little_endian<uint32_t>(record, masked_crc32c(event.data(), event.size()));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() || std::fflush(file_) != 0) {
    throw std::runtime_error("cannot write the TensorBoard events file " + path_ + ": " + std::strerror(errno));
  }
}

}  // namespace harness::train
