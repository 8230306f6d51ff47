// TensorBoard event files written directly: TFRecord framing (length, masked CRC-32C of the
// length, the record, masked CRC-32C of the record) around Event protos holding scalar summaries,
// encoded by hand (the few fields a scalar needs), so that no protobuf library is needed.
// TensorBoard, tensorboard's EventAccumulator and TensorFlow's readers read them.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace harness::train {

// CRC-32C (Castagnoli), and TFRecord's masking of it: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

class TensorBoardWriter {
 public:
  // Creates `dir` and a new events.out.tfevents.<time>.<host>.<pid> file in it (one per run, as
  // TensorBoard expects), starting with the file-version event. `resumed_step` >= 0: the run
  // continues one that may have logged beyond that step; a session-start event at the next step
  // makes TensorBoard drop those later points.
  TensorBoardWriter(const std::string& dir, int64_t resumed_step = -1);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One scalar (TensorBoard keeps it as a float), written and flushed.
  void add_scalar(const std::string& tag, double value, int64_t step);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace harness::train
