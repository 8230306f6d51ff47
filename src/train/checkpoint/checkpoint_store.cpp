// Checkpoint folders on disk (see checkpoint_store.h): SHA-256, durable writes, the manifest's
// strict reader, the atomic writer, listing, verification and pruning. No torch here.
#include "harness/train/checkpoint/checkpoint_store.h"

#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <set>
#include <stdexcept>

namespace harness::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// SHA-256, FIPS 180-4 §6.2.

constexpr std::array<uint32_t, 64> kRoundConstants = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

constexpr size_t kFileChunkBytes = size_t{1} << 20;

uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

class Sha256 {
 public:
  void update(const uint8_t* data, size_t size) {
    total_bytes_ += size;
    while (size > 0) {
      const size_t take = std::min(size, buffer_.size() - buffered_);
      std::memcpy(buffer_.data() + buffered_, data, take);
      buffered_ += take;
      data += take;
      size -= take;
      if (buffered_ == buffer_.size()) {
        compress(buffer_.data());
        buffered_ = 0;
      }
    }
  }

  std::string hex_digest() {
    // Padding: 0x80, zeros up to 56 mod 64, then the message length in bits, big-endian.
    const uint64_t bit_length = total_bytes_ * 8;
    const uint8_t one_bit = 0x80;
    update(&one_bit, 1);
    const uint8_t zero = 0;
    while (buffered_ != 56) update(&zero, 1);
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(bit_length >> (56 - 8 * i));
    update(length, 8);

    static const char* digits = "0123456789abcdef";
    std::string hex;
    hex.reserve(64);
    for (uint32_t word : state_) {
      for (int shift = 28; shift >= 0; shift -= 4) hex.push_back(digits[(word >> shift) & 0xf]);
    }
    return hex;
  }

 private:
  void compress(const uint8_t* block) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = (uint32_t{block[4 * i]} << 24) | (uint32_t{block[4 * i + 1]} << 16) |
             (uint32_t{block[4 * i + 2]} << 8) | uint32_t{block[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                          kRoundConstants[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  std::array<uint32_t, 8> state_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

// ---------------------------------------------------------------------------------------------
// POSIX helpers.

[[noreturn]] void fail_errno(const std::string& path, const std::string& action, int error) {
  throw std::runtime_error(path + ": " + action + " failed (" + std::strerror(error) + ")");
}

// Closes on scope exit so an exception between open and close cannot leak the descriptor.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  // close(2) can report a deferred write error, so callers that wrote check it.
  int release_and_close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

int open_for_reading(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(path, "open for reading", errno);
  return fd;
}

// Calls consume(data, size) for each chunk of the file.
template <typename Consume>
void read_chunks(const std::string& path, Consume consume) {
  FileDescriptor fd(open_for_reading(path));
  std::vector<uint8_t> chunk(kFileChunkBytes);
  while (true) {
    const ssize_t n = ::read(fd.get(), chunk.data(), chunk.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "read", errno);
    }
    if (n == 0) return;
    consume(chunk.data(), static_cast<size_t>(n));
  }
}

std::string read_whole_file(const std::string& path) {
  std::string text;
  read_chunks(path, [&](const uint8_t* data, size_t size) {
    text.append(reinterpret_cast<const char*>(data), size);
  });
  return text;
}

std::string join(const std::string& folder, const std::string& name) {
  if (folder.empty()) return name;
  if (folder.back() == '/') return folder + name;
  return folder + "/" + name;
}

// "a/b/" and "a/b" name the same folder; the trailing slash would only make paths uglier.
std::string without_trailing_slashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

void rename_or_throw(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int error = errno;
    throw std::runtime_error("cannot rename " + from + " to " + to + " (" + std::strerror(error) +
                             ")");
  }
}

// Failure details out of nftw's callback, which has no user pointer.
thread_local std::string remove_failed_entry;
thread_local int remove_failed_errno = 0;

int remove_one_entry(const char* path, const struct stat*, int type, struct FTW*) {
  const bool is_folder = type == FTW_DP || type == FTW_D || type == FTW_DNR;
  const int rc = is_folder ? ::rmdir(path) : ::unlink(path);
  if (rc != 0 && errno != ENOENT) {
    remove_failed_entry = path;
    remove_failed_errno = errno;
    return 1;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint names.

constexpr const char* kStepPrefix = "step-";
constexpr int kStepDigits = 8;
constexpr const char* kTempInfix = ".tmp-";

std::string temp_name(int64_t global_step, pid_t pid) {
  return "." + checkpoint_name(global_step) + kTempInfix + std::to_string(pid);
}

// ".step-00000012.tmp-4242" and ".step-00000012.tmp-4242.discard-3" -> 4242; else nullopt.
std::optional<pid_t> parse_temp_pid(const std::string& name) {
  if (name.empty() || name[0] != '.') return std::nullopt;
  const size_t infix = name.find(kTempInfix);
  if (infix == std::string::npos || !parse_checkpoint_name(name.substr(1, infix - 1))) {
    return std::nullopt;
  }
  size_t i = infix + std::strlen(kTempInfix);
  int64_t pid = 0;
  const size_t digits_begin = i;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') {
    pid = pid * 10 + (name[i] - '0');
    if (pid > INT_MAX) return std::nullopt;
    ++i;
  }
  if (i == digits_begin || pid <= 0) return std::nullopt;
  if (i < name.size() && name[i] != '.') return std::nullopt;
  return static_cast<pid_t>(pid);
}

// A complete checkpoint is first renamed out of the step-N names, then deleted: deleting in place
// could leave, after a crash, a folder that still holds manifest.json but lacks other files and so
// would be listed as complete. A leftover renamed folder is a temporary one that pruning removes.
void discard_checkpoint_folder(const std::string& root, const std::string& path,
                               int64_t global_step) {
  static std::atomic<uint64_t> discard_count{0};
  const std::string doomed = join(root, temp_name(global_step, ::getpid()) + ".discard-" +
                                            std::to_string(discard_count.fetch_add(1)));
  rename_or_throw(path, doomed);
  remove_tree(doomed);
}

// ---------------------------------------------------------------------------------------------
// Manifest fields.

// Empty when `name` may be listed in a manifest, else why not.
std::string file_name_problem(const std::string& name) {
  if (name.empty()) return "is empty";
  if (name.find('\0') != std::string::npos) return "contains a NUL character";
  if (name[0] == '/') return "is absolute; names are relative to the checkpoint folder";
  if (name == kManifestName) return std::string("is the manifest itself (") + kManifestName + ")";
  size_t begin = 0;
  while (true) {
    const size_t end = name.find('/', begin);
    const std::string part =
        name.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    if (part.empty()) return "has an empty path component";
    if (part == "." || part == "..")
      return "has a '" + part + "' component; it must stay inside the checkpoint folder";
    if (end == std::string::npos) return "";
    begin = end + 1;
  }
}

bool is_lowercase_sha256(const std::string& text) {
  if (text.size() != 64) return false;
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A value as the error shows it: its JSON text, cut short, invalid UTF-8 replaced.
std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return std::string(value.type_name()) + " " + text;
}

class FieldReader {
 public:
  explicit FieldReader(const std::string& origin) : origin_(origin) {}

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw std::runtime_error(origin_ + ": field '" + field + "' " + problem);
  }

  const json& get(const json& object, const std::string& key, const std::string& field) const {
    const auto it = object.find(key);
    if (it == object.end()) fail(field, "is missing");
    return *it;
  }

  int64_t integer(const json& object, const std::string& key, const std::string& field, int64_t min,
                  int64_t max = INT64_MAX) const {
    const json& value = get(object, key, field);
    if (!value.is_number_integer()) fail(field, "must be an integer, got " + shown(value));
    if (value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      fail(field, "is out of range: " + value.dump());
    }
    const int64_t v = value.get<int64_t>();
    if (v < min) fail(field, "must be >= " + std::to_string(min) + ", got " + std::to_string(v));
    if (v > max) fail(field, "must be <= " + std::to_string(max) + ", got " + std::to_string(v));
    return v;
  }

  uint64_t size(const json& object, const std::string& key, const std::string& field) const {
    const json& value = get(object, key, field);
    if (!value.is_number_integer()) fail(field, "must be an integer, got " + shown(value));
    if (!value.is_number_unsigned() && value.get<int64_t>() < 0) {
      fail(field, "must be >= 0, got " + value.dump());
    }
    return value.get<uint64_t>();
  }

  std::string string(const json& object, const std::string& key, const std::string& field) const {
    const json& value = get(object, key, field);
    if (!value.is_string()) fail(field, "must be a string, got " + shown(value));
    return value.get<std::string>();
  }

  // Refuses keys outside `known`: a misspelt or unexpected field is a writer bug worth seeing.
  void only_known_keys(const json& object, const std::set<std::string>& known,
                       const std::string& prefix) const {
    for (const auto& item : object.items()) {
      if (!known.count(item.key()))
        fail(prefix + item.key(),
             "is not a field of format_version " + std::to_string(kCheckpointFormatVersion));
    }
  }

 private:
  const std::string& origin_;
};

std::vector<ManifestFile> files_from_json(const json& list, const FieldReader& reader) {
  if (!list.is_array()) reader.fail("files", "must be an array, got " + shown(list));
  std::vector<ManifestFile> files;
  std::set<std::string> seen;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string field = "files[" + std::to_string(i) + "]";
    const json& entry = list[i];
    if (!entry.is_object()) reader.fail(field, "must be an object, got " + shown(entry));
    reader.only_known_keys(entry, {"name", "size", "sha256"}, field + ".");
    ManifestFile file;
    file.name = reader.string(entry, "name", field + ".name");
    const std::string problem = file_name_problem(file.name);
    if (!problem.empty()) reader.fail(field + ".name", "\"" + file.name + "\" " + problem);
    if (!seen.insert(file.name).second) {
      reader.fail(field + ".name", "\"" + file.name + "\" is listed twice");
    }
    file.size = reader.size(entry, "size", field + ".size");
    file.sha256 = reader.string(entry, "sha256", field + ".sha256");
    if (!is_lowercase_sha256(file.sha256)) {
      reader.fail(field + ".sha256",
                  "must be 64 lowercase hex digits, got \"" + file.sha256 + "\"");
    }
    files.push_back(std::move(file));
  }
  return files;
}

// nlohmann's copy and destruction recurse once per nesting level, so a damaged manifest nested
// deeply enough would overflow the stack; refuse it before parsing.
constexpr int kMaxManifestNesting = 64;

void check_json_nesting(const std::string& text, const std::string& origin) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // skip the escaped character
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxManifestNesting) {
        throw std::runtime_error(origin + ": JSON nests more than " +
                                 std::to_string(kMaxManifestNesting) + " levels deep (at byte " +
                                 std::to_string(i) + ")");
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

std::string utc_now_iso8601() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

bool process_may_be_running(pid_t pid) {
  // EPERM: it exists but belongs to someone else, so it may still be writing.
  return ::kill(pid, 0) == 0 || errno != ESRCH;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string sha256_hex(const void* data, size_t size) {
  Sha256 hash;
  hash.update(static_cast<const uint8_t*>(data), size);
  return hash.hex_digest();
}

std::string sha256_file(const std::string& path) {
  Sha256 hash;
  read_chunks(path, [&](const uint8_t* data, size_t size) { hash.update(data, size); });
  return hash.hex_digest();
}

void remove_tree(const std::string& path) {
  if (path.empty()) throw std::invalid_argument("remove_tree: empty path");
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) {
    if (errno == ENOENT) return;
    fail_errno(path, "remove (lstat)", errno);
  }
  remove_failed_entry.clear();
  remove_failed_errno = 0;
  // FTW_PHYS: a symbolic link is removed, never followed into what it points at.
  const int rc = ::nftw(path.c_str(), remove_one_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc == 0) return;
  if (!remove_failed_entry.empty()) {
    throw std::runtime_error("cannot remove " + path + ": removing " + remove_failed_entry +
                             " failed (" + std::strerror(remove_failed_errno) + ")");
  }
  const int error = errno;
  if (::lstat(path.c_str(), &info) != 0 && errno == ENOENT)
    return;  // removed by someone else meanwhile
  fail_errno(path, "remove (nftw)", error);
}

void write_file_synced(const std::string& path, const std::string& bytes) {
  int raw;
  do {
    raw = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (raw < 0 && errno == EINTR);
  if (raw < 0) fail_errno(path, "open for writing", errno);
  FileDescriptor fd(raw);
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd.get(), bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "write", errno);
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) fail_errno(path, "fsync", errno);
  if (fd.release_and_close() != 0) fail_errno(path, "close", errno);
}

void fsync_path(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) fail_errno(path, "fsync (stat)", errno);
  const bool is_folder = S_ISDIR(info.st_mode);
  int raw;
  do {
    raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (is_folder ? O_DIRECTORY : 0));
  } while (raw < 0 && errno == EINTR);
  if (raw < 0) fail_errno(path, "open for fsync", errno);
  FileDescriptor fd(raw);
  // Some file systems cannot fsync a directory (EINVAL); their entries are as durable as they get.
  if (::fsync(fd.get()) != 0 && !(is_folder && errno == EINVAL)) fail_errno(path, "fsync", errno);
}

// ---------------------------------------------------------------------------------------------

json manifest_to_json(const CheckpointManifest& manifest) {
  json files = json::array();
  for (const ManifestFile& file : manifest.files) {
    files.push_back({{"name", file.name}, {"size", file.size}, {"sha256", file.sha256}});
  }
  return {
      {"format_version", manifest.format_version},
      {"program", manifest.program},
      {"world_size", manifest.plan_size("world_size")},
      {"tensor_parallel_size", manifest.plan_size("tensor_parallel_size")},
      {"data_parallel_size", manifest.plan_size("data_parallel_size")},
      {"plan", manifest.plan},
      {"pipeline_devices", manifest.pipeline_devices},
      {"model_config", manifest.model_config},
      {"global_step", manifest.global_step},
      {"epoch", manifest.epoch},
      {"batch_in_epoch", manifest.batch_in_epoch},
      {"created_at", manifest.created_at},
      {"files", std::move(files)},
  };
}

CheckpointManifest manifest_from_json(const json& j, const std::string& origin) {
  if (!j.is_object()) {
    throw std::runtime_error(origin + ": expected a JSON object, got " + shown(j));
  }
  const FieldReader reader(origin);
  CheckpointManifest m;
  // The version first: another version may have other fields, and saying so is the useful error.
  const json& version = reader.get(j, "format_version", "format_version");
  if (!version.is_number_integer()) {
    reader.fail("format_version", "must be an integer, got " + shown(version));
  }
  if (version != kCheckpointFormatVersion) {
    reader.fail("format_version", "is " + version.dump() +
                                      ", but this build reads format_version " +
                                      std::to_string(kCheckpointFormatVersion) + " only");
  }
  m.format_version = kCheckpointFormatVersion;
  reader.only_known_keys(j,
                         {"format_version", "program", "world_size", "tensor_parallel_size",
                          "data_parallel_size", "pipeline_devices", "model_config", "global_step",
                          "epoch", "batch_in_epoch", "created_at", "files", "plan"},
                         "");

  m.program = reader.string(j, "program", "program");
  if (m.program.empty()) reader.fail("program", "must not be empty");
  // The plan: the three sizes at the top level, and the whole plan under "plan" where it was
  // recorded (a checkpoint written before has the sizes only), agreeing with them.
  m.plan = json::object();
  if (j.contains("plan")) {
    m.plan = j.at("plan");
    if (!m.plan.is_object()) reader.fail("plan", "must be an object, got " + shown(m.plan));
  }
  for (const char* key : {"world_size", "tensor_parallel_size", "data_parallel_size"}) {
    const int64_t size = reader.integer(j, key, key, 1, INT_MAX);
    if (m.plan.contains(key) && m.plan.at(key) != size) {
      reader.fail(std::string("plan.") + key, "is " + m.plan.at(key).dump() + ", but the manifest's " + key +
                                                  " is " + std::to_string(size));
    }
    m.plan[key] = size;
  }

  const json& devices = reader.get(j, "pipeline_devices", "pipeline_devices");
  if (!devices.is_array())
    reader.fail("pipeline_devices", "must be an array, got " + shown(devices));
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!devices[i].is_string()) {
      reader.fail("pipeline_devices[" + std::to_string(i) + "]",
                  "must be a string, got " + shown(devices[i]));
    }
    m.pipeline_devices.push_back(devices[i].get<std::string>());
  }

  m.model_config = reader.get(j, "model_config", "model_config");
  if (!m.model_config.is_object()) {
    reader.fail("model_config", "must be an object, got " + shown(m.model_config));
  }
  m.global_step = reader.integer(j, "global_step", "global_step", 0);
  m.epoch = reader.integer(j, "epoch", "epoch", 0);
  m.batch_in_epoch = reader.integer(j, "batch_in_epoch", "batch_in_epoch", 0);
  m.created_at = reader.string(j, "created_at", "created_at");
  m.files = files_from_json(reader.get(j, "files", "files"), reader);
  return m;
}

CheckpointManifest read_manifest(const std::string& checkpoint_path) {
  const std::string origin = join(checkpoint_path, kManifestName);
  const std::string text = read_whole_file(origin);
  check_json_nesting(text, origin);
  json parsed;
  try {
    parsed = json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(origin + ": not valid JSON (" + e.what() + ")");
  }
  return manifest_from_json(parsed, origin);
}

// ---------------------------------------------------------------------------------------------

std::string checkpoint_name(int64_t global_step) {
  if (global_step < 0) {
    throw std::invalid_argument("checkpoint_name: global_step " + std::to_string(global_step) +
                                " is negative");
  }
  std::string digits = std::to_string(global_step);
  if (digits.size() < static_cast<size_t>(kStepDigits)) {
    digits.insert(0, kStepDigits - digits.size(), '0');
  }
  return kStepPrefix + digits;
}

std::optional<int64_t> parse_checkpoint_name(const std::string& name) {
  const size_t prefix = std::strlen(kStepPrefix);
  if (name.compare(0, prefix, kStepPrefix) != 0) return std::nullopt;
  const std::string digits = name.substr(prefix);
  if (digits.size() < static_cast<size_t>(kStepDigits)) return std::nullopt;
  // Wider than 8 digits only without leading zeros: one name per step, checkpoint_name's.
  if (digits.size() > static_cast<size_t>(kStepDigits) && digits[0] == '0') return std::nullopt;
  int64_t step = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    if (step > (INT64_MAX - (c - '0')) / 10) return std::nullopt;
    step = step * 10 + (c - '0');
  }
  return step;
}

// ---------------------------------------------------------------------------------------------

CheckpointWriter::CheckpointWriter(std::string root, int64_t global_step,
                                   std::function<void(Stage)> on_stage)
    : root_(without_trailing_slashes(std::move(root))),
      global_step_(global_step),
      on_stage_(std::move(on_stage)) {
  if (root_.empty()) throw std::invalid_argument("CheckpointWriter: empty checkpoint root");
  const std::string name = checkpoint_name(global_step_);  // refuses a negative step
  stage(Stage::kCreateTemp);
  std::error_code error;
  const bool created_root = fs::create_directories(root_, error);
  if (error)
    throw std::runtime_error(root_ + ": cannot create the checkpoint root (" + error.message() +
                             ")");
  if (created_root) {
    const std::string parent = fs::path(root_).parent_path().string();
    fsync_path(parent.empty() ? "." : parent);
  }
  const std::string temp = join(root_, temp_name(global_step_, ::getpid()));
  remove_tree(temp);  // an earlier writer of this process that could not clean up
  if (::mkdir(temp.c_str(), 0755) != 0) fail_errno(temp, "mkdir", errno);
  // Only now the destructor has something to remove.
  temp_path_ = temp;
  final_path_ = join(root_, name);
}

CheckpointWriter::~CheckpointWriter() {
  if (committed_ || temp_path_.empty()) return;
  try {
    remove_tree(temp_path_);
  } catch (const std::exception& e) {
    // A destructor must not throw; prune_checkpoints removes the leftover later.
    std::cerr << "warning: uncommitted checkpoint folder left behind: " << e.what() << "\n";
  }
}

void CheckpointWriter::stage(Stage s) const {
  if (on_stage_) on_stage_(s);
}

void CheckpointWriter::check_addable(const std::string& file_name) const {
  if (committed_) {
    throw std::logic_error(final_path_ + ": cannot add " + file_name + " after commit()");
  }
  const std::string problem = file_name_problem(file_name);
  if (!problem.empty()) {
    throw std::invalid_argument(temp_path_ + ": checkpoint file name \"" + file_name + "\" " +
                                problem);
  }
  for (const ManifestFile& file : files_) {
    if (file.name == file_name) {
      throw std::invalid_argument(temp_path_ + ": " + file_name + " was already added");
    }
  }
}

std::string CheckpointWriter::path_for(const std::string& file_name) const {
  const std::string problem = file_name_problem(file_name);
  if (!problem.empty()) {
    throw std::invalid_argument(temp_path_ + ": checkpoint file name \"" + file_name + "\" " +
                                problem);
  }
  return join(temp_path_, file_name);
}

void CheckpointWriter::add_file(const std::string& file_name) {
  check_addable(file_name);
  stage(Stage::kAddFile);
  const std::string path = path_for(file_name);
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) {
    const int error = errno;
    throw std::runtime_error(path + ": cannot add " + file_name + " to the checkpoint (" +
                             std::strerror(error) + "); write it at path_for(\"" + file_name +
                             "\") first");
  }
  if (!S_ISREG(info.st_mode)) {
    throw std::runtime_error(path + ": cannot add " + file_name + ", it is not a regular file");
  }
  fsync_path(path);
  files_.push_back({file_name, static_cast<uint64_t>(info.st_size), sha256_file(path)});
}

void CheckpointWriter::add_bytes(const std::string& file_name, const std::string& bytes) {
  check_addable(file_name);
  stage(Stage::kAddFile);
  const std::string path = path_for(file_name);
  const fs::path parent = fs::path(path).parent_path();
  if (parent != fs::path(temp_path_)) {
    std::error_code error;
    fs::create_directories(parent, error);
    if (error)
      throw std::runtime_error(parent.string() + ": cannot create folder (" + error.message() +
                               ")");
  }
  write_file_synced(path, bytes);
  files_.push_back({file_name, bytes.size(), sha256_hex(bytes.data(), bytes.size())});
}

std::string CheckpointWriter::commit(CheckpointManifest manifest) {
  if (committed_) throw std::logic_error(final_path_ + ": commit() called twice");
  if (manifest.global_step != global_step_) {
    throw std::invalid_argument(final_path_ + ": manifest.global_step is " +
                                std::to_string(manifest.global_step) +
                                " but this writer is for step " + std::to_string(global_step_));
  }
  manifest.files = files_;
  if (manifest.created_at.empty()) manifest.created_at = utc_now_iso8601();
  const std::string manifest_file = join(temp_path_, kManifestName);
  const json manifest_json = manifest_to_json(manifest);
  // Never write what read_manifest would refuse.
  manifest_from_json(manifest_json, manifest_file);
  std::string text;
  try {
    text = manifest_json.dump(2) + "\n";
  } catch (const json::exception& e) {
    throw std::runtime_error(manifest_file + ": cannot serialise the manifest (" + e.what() + ")");
  }

  stage(Stage::kWriteManifest);
  write_file_synced(manifest_file, text);

  stage(Stage::kSyncTemp);
  // Subfolders of the files (deepest first), then the folder itself, so every entry is durable.
  std::set<std::string, std::greater<>> subfolders;
  for (const ManifestFile& file : files_) {
    for (fs::path parent = fs::path(file.name).parent_path(); !parent.empty();
         parent = parent.parent_path()) {
      subfolders.insert(parent.string());
    }
  }
  for (const std::string& subfolder : subfolders) fsync_path(join(temp_path_, subfolder));
  fsync_path(temp_path_);

  stage(Stage::kRename);
  struct stat info;
  if (::lstat(final_path_.c_str(), &info) == 0) {
    discard_checkpoint_folder(root_, final_path_, global_step_);
  } else if (errno != ENOENT) {
    fail_errno(final_path_, "lstat", errno);
  }
  rename_or_throw(temp_path_, final_path_);

  try {
    stage(Stage::kSyncRoot);
    fsync_path(root_);
  } catch (...) {
    // Not durable means not committed: move it back out of the step-N names for the destructor.
    if (::rename(final_path_.c_str(), temp_path_.c_str()) != 0) {
      std::cerr << "warning: " << final_path_ << " is complete but its rename may not be durable\n";
      committed_ = true;  // nothing is left at temp_path_ to remove
    }
    throw;
  }
  committed_ = true;
  return final_path_;
}

// ---------------------------------------------------------------------------------------------

std::vector<CheckpointInfo> list_checkpoints(const std::string& root) {
  std::vector<CheckpointInfo> found;
  std::error_code error;
  if (!fs::exists(root, error)) {
    if (error)
      throw std::runtime_error(root + ": cannot list checkpoints (" + error.message() + ")");
    return found;
  }
  if (!fs::is_directory(root, error)) {
    throw std::runtime_error(root + ": checkpoint root is not a folder");
  }
  fs::directory_iterator it(root, error);
  if (error) throw std::runtime_error(root + ": cannot list checkpoints (" + error.message() + ")");
  for (const fs::directory_entry& entry : it) {
    const std::optional<int64_t> step = parse_checkpoint_name(entry.path().filename().string());
    if (!step) continue;
    std::error_code ignored;
    if (!entry.is_directory(ignored)) continue;
    if (!fs::is_regular_file(entry.path() / kManifestName, ignored)) continue;
    found.push_back(
        {*step, join(without_trailing_slashes(root), entry.path().filename().string())});
  }
  std::sort(found.begin(), found.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) {
    return a.global_step < b.global_step;
  });
  return found;
}

CheckpointManifest verify_checkpoint(const std::string& checkpoint_path) {
  const CheckpointManifest manifest = read_manifest(checkpoint_path);
  const std::string folder =
      fs::path(without_trailing_slashes(checkpoint_path)).filename().string();
  const std::optional<int64_t> folder_step = parse_checkpoint_name(folder);
  if (folder_step && *folder_step != manifest.global_step) {
    throw std::runtime_error(checkpoint_path + ": the folder is named for step " +
                             std::to_string(*folder_step) + ", the manifest says global_step " +
                             std::to_string(manifest.global_step));
  }
  for (const ManifestFile& file : manifest.files) {
    const std::string path = join(checkpoint_path, file.name);
    struct stat info;
    if (::stat(path.c_str(), &info) != 0) {
      const int error = errno;
      throw std::runtime_error(
          checkpoint_path + ": " + file.name + " is listed in the manifest but " +
          (error == ENOENT ? std::string("missing")
                           : std::string("unreadable (") + std::strerror(error) + ")"));
    }
    if (!S_ISREG(info.st_mode)) {
      throw std::runtime_error(checkpoint_path + ": " + file.name + " is not a regular file");
    }
    const uint64_t size = static_cast<uint64_t>(info.st_size);
    if (size != file.size) {
      throw std::runtime_error(checkpoint_path + ": " + file.name + " has " + std::to_string(size) +
                               " bytes, the manifest says " + std::to_string(file.size));
    }
    if (sha256_file(path) != file.sha256) {
      throw std::runtime_error(checkpoint_path + ": " + file.name +
                               " SHA-256 differs from the manifest (corrupted)");
    }
  }
  return manifest;
}

std::vector<std::string> prune_checkpoints(const std::string& root, int keep,
                                           const std::string& in_use_temp) {
  if (keep < 1) {
    throw std::invalid_argument(root + ": prune_checkpoints keep is " + std::to_string(keep) +
                                ", expected >= 1 (the newest checkpoint is never removed)");
  }
  std::vector<std::string> removed;
  const std::vector<CheckpointInfo> complete = list_checkpoints(root);
  const size_t keep_count = static_cast<size_t>(keep);
  for (size_t i = 0; i + keep_count < complete.size(); ++i) {
    discard_checkpoint_folder(without_trailing_slashes(root), complete[i].path,
                              complete[i].global_step);
    removed.push_back(complete[i].path);
  }
  if (complete.empty() && !fs::exists(root)) return removed;

  const std::string in_use_name =
      in_use_temp.empty() ? ""
                          : fs::path(without_trailing_slashes(in_use_temp)).filename().string();
  const pid_t own_pid = ::getpid();
  std::vector<std::string> stale;
  for (const fs::directory_entry& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    const std::optional<pid_t> pid = parse_temp_pid(name);
    if (!pid) continue;
    const bool stale_own = *pid == own_pid && name != in_use_name;
    if (stale_own || (*pid != own_pid && !process_may_be_running(*pid))) {
      stale.push_back(join(without_trailing_slashes(root), name));
    }
  }
  std::sort(stale.begin(), stale.end());
  for (const std::string& path : stale) {
    remove_tree(path);
    removed.push_back(path);
  }
  return removed;
}

}  // namespace harness::train
