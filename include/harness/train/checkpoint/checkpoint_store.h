// Torch-free storage of training checkpoints: one folder per optimizer step, written atomically
// (temporary folder, fsync, rename), described by a manifest with each file's size and SHA-256.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace harness::train {

// SHA-256 (FIPS 180-4), own implementation, lowercase hex.
std::string sha256_hex(const void* data, size_t size);
std::string sha256_file(
    const std::string& path);  // streams the file in chunks; errors name the path

// Removes a file or a whole folder tree without following symbolic links (nftw, not
// std::filesystem::remove_all, whose copy exported by libtorch.so crashes). A missing path is not
// an error; any other failure throws std::runtime_error naming the path.
void remove_tree(const std::string& path);

// Writes `bytes` to `path` durably: open (truncating), write all, fsync, close.
void write_file_synced(const std::string& path, const std::string& bytes);
// fsyncs a file or a directory; a directory's fsync makes the entries created in it durable.
void fsync_path(const std::string& path);

constexpr int kCheckpointFormatVersion = 1;
constexpr const char* kManifestName = "manifest.json";

struct ManifestFile {
  std::string name;  // relative to the checkpoint folder, e.g. "model.safetensors"
  uint64_t size = 0;
  std::string sha256;
};

struct CheckpointManifest {
  int format_version = kCheckpointFormatVersion;
  std::string program;  // "run_data_parallel" | "run_pipeline"
  // The plan the checkpoint was written under (plan/plan.h's plan_to_json): at least its
  // world_size, tensor_parallel_size and data_parallel_size, integers >= 1, which the manifest also
  // gives at its top level (all a checkpoint written before the whole plan was recorded has).
  nlohmann::json plan = {{"world_size", 1}, {"tensor_parallel_size", 1}, {"data_parallel_size", 1}};
  int plan_size(const std::string& key) const { return plan.at(key).get<int>(); }
  std::vector<std::string> pipeline_devices;  // empty outside run_pipeline's model/pipeline modes
  nlohmann::json model_config = nlohmann::json::object();  // the model's config.json contents
  int64_t global_step = 0;     // optimizer steps done
  int64_t epoch = 0;           // epoch in progress (the next when batch_in_epoch == 0 at its end)
  int64_t batch_in_epoch = 0;  // batches of `epoch` already trained
  std::string created_at;      // ISO-8601 UTC, informational
  std::vector<ManifestFile> files;
};

nlohmann::json manifest_to_json(const CheckpointManifest& manifest);
// Strict: every field present with its type and nothing else, format_version ==
// kCheckpointFormatVersion, counts >= 1, steps and sizes >= 0, sha256 64 lowercase hex digits,
// file names relative, without "." or ".." components, unique and not manifest.json itself.
// Errors are std::runtime_error starting with `origin`:
// "<path>/manifest.json: field 'global_step' must be an integer, got string \"12\"".
CheckpointManifest manifest_from_json(const nlohmann::json& json, const std::string& origin);
// <checkpoint_path>/manifest.json; unreadable, too deeply nested or malformed JSON is reported
// with that path.
CheckpointManifest read_manifest(const std::string& checkpoint_path);

// "step-00000012" (8 digits, wider when needed) <-> 12. Parsing accepts exactly the names
// checkpoint_name produces, so each step has one folder name.
std::string checkpoint_name(int64_t global_step);
std::optional<int64_t> parse_checkpoint_name(const std::string& name);

// Atomic creation of one checkpoint folder <root>/<checkpoint_name(step)>. Files go into a
// temporary sibling "<root>/.step-XXXXXXXX.tmp-<pid>", each fsync'd when added; commit() writes
// manifest.json (fsync), fsyncs the temporary folder, renames it to the final name (an existing
// folder of that name, older and incomplete or superseded, is removed first) and fsyncs <root>.
// A partial folder never appears under the final name: commit() either returns with the checkpoint
// durable or throws with no new checkpoint, and the destructor removes what was not committed.
class CheckpointWriter {
 public:
  enum class Stage { kCreateTemp, kAddFile, kWriteManifest, kSyncTemp, kRename, kSyncRoot };

  // on_stage (tests only) is called at the start of each stage and may throw to inject a failure.
  CheckpointWriter(std::string root, int64_t global_step, std::function<void(Stage)> on_stage = {});
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  const std::string& temp_path() const { return temp_path_; }
  // temp_path()/file_name, for the caller to write into (it creates any subfolder itself).
  std::string path_for(const std::string& file_name) const;
  // After the caller has written path_for(file_name): fsyncs it and records its size and SHA-256.
  void add_file(const std::string& file_name);
  // write_file_synced (creating subfolders of file_name) and record.
  void add_bytes(const std::string& file_name, const std::string& bytes);
  // manifest.global_step must be this writer's step; files is replaced by what was added (in
  // order) and an empty created_at is set to now. Returns the final folder path.
  std::string commit(CheckpointManifest manifest);

 private:
  void stage(Stage s) const;
  void check_addable(const std::string& file_name) const;

  std::string root_;
  int64_t global_step_;
  std::function<void(Stage)> on_stage_;
  std::string temp_path_;
  std::string final_path_;
  std::vector<ManifestFile> files_;
  bool committed_ = false;
};

struct CheckpointInfo {
  int64_t global_step = 0;
  std::string path;
};
// Complete checkpoints under root (folders named step-N holding manifest.json; temporary ".step-*"
// folders and anything else ignored), oldest first. A missing root gives an empty list.
std::vector<CheckpointInfo> list_checkpoints(const std::string& root);

// Reads the manifest and checks every listed file: present, of the recorded size, of the recorded
// SHA-256. Throws std::runtime_error naming the checkpoint, the file and what differs.
CheckpointManifest verify_checkpoint(const std::string& checkpoint_path);

// Keeps the newest `keep` (>= 1) complete checkpoints and removes the older ones, and removes
// temporary ".step-*.tmp-<pid>" folders whose process is gone (kill(pid, 0) gives ESRCH) or is
// this process but which are not `in_use_temp` (a CheckpointWriter's temp_path(), or empty).
// Pids are only meaningful on this host: do not share a root between hosts' writers.
// Returns the removed paths.
std::vector<std::string> prune_checkpoints(const std::string& root, int keep,
                                           const std::string& in_use_temp = "");

}  // namespace harness::train
