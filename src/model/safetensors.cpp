// A validating safetensors reader/writer (no external library) and GPT-2 load/save in Hugging
// Face's layout. Format: u64 little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data.
#include "harness/model/safetensors.h"

#include "json_depth.h"
#include "shape_text.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include <fcntl.h>
#include <unistd.h>

namespace harness::model {
namespace {

using json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;
// A valid header nests three levels ({name: {shape: [...]}}). nlohmann's copy and destruction
// recurse per level, so a deeply nested header would overflow the stack (found by the fuzzer).
constexpr int kMaxJsonDepth = 16;

struct Entry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

[[noreturn]] void fail(const std::string& origin, const std::string& what) {
  throw std::runtime_error(origin + ": " + what);
}

std::string dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "F32";
    case torch::kHalf: return "F16";
    case torch::kBFloat16: return "BF16";
    default: return c10::toString(t);
  }
}

torch::ScalarType parse_dtype(const std::string& text, const std::string& origin,
                              const std::string& tensor) {
  if (text == "F32") return torch::kFloat;
  if (text == "F16") return torch::kHalf;
  if (text == "BF16") return torch::kBFloat16;
  fail(origin, "tensor " + tensor + " has dtype \"" + text +
                   "\"; only F32, F16 and BF16 are supported");
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Checks the 8-byte prefix against the file size; returns the header length.
uint64_t check_header_length(uint64_t header_len, uint64_t file_size, const std::string& origin) {
  if (header_len > kMaxHeaderBytes) {
    fail(origin, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes (corrupt file?)");
  }
  if (header_len > file_size - 8) {
    fail(origin, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                     std::to_string(file_size) + " bytes; truncated?)");
  }
  if (header_len < 2) fail(origin, "header length " + std::to_string(header_len) + " is too small");
  return header_len;
}

// Cuts `text` after max_bytes (at a UTF-8 character boundary), marking the cut with "...".
std::string cut(std::string text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t end = max_bytes;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end) + "...";
}

// A JSON value for a one-line error message: scalars as JSON, containers by their size, since
// dump() would copy a whole (maybe huge) subtree into the message.
std::string shown(const json& v) {
  if (v.is_object()) return "an object with " + std::to_string(v.size()) + " key(s)";
  if (v.is_array()) return "an array of " + std::to_string(v.size()) + " element(s)";
  return cut(v.dump(-1, ' ', false, json::error_handler_t::replace), 60);
}

// A tensor name or key from the file, for a one-line message: control characters escaped.
std::string printable(const std::string& name) {
  std::string out;
  for (const char c : cut(name, 200)) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned char>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out;
}

uint64_t read_offset(const json& v, const std::string& origin, const std::string& tensor) {
  if (!v.is_number_unsigned()) {
    fail(origin, "tensor " + tensor + ": data_offsets must hold non-negative integers, got " + shown(v));
  }
  return v.get<uint64_t>();
}

std::string range_str(const Entry& e) {
  return "[" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
}

// The format requires the tensors' data (sorted by offset) to tile the data section: the first
// begins at 0, each begins where the previous ends, the last ends at the end of the file. An
// overlap would alias two tensors' bytes and a gap would hide bytes that no tensor owns.
void check_tiling(const std::vector<Entry>& sorted, uint64_t data_size, const std::string& origin) {
  uint64_t expected_begin = 0;
  const Entry* previous = nullptr;
  for (const Entry& e : sorted) {
    if (e.begin != expected_begin) {
      const std::string where = "tensor " + printable(e.name) + ": data_offsets " + range_str(e);
      if (previous == nullptr) {
        fail(origin, where + " leave bytes [0, " + std::to_string(e.begin) +
                         ") of the data section unused; expected the first tensor to begin at 0");
      }
      if (e.begin < expected_begin) {
        fail(origin, where + " overlap tensor " + printable(previous->name) + "'s " + range_str(*previous) +
                         "; expected it to begin at " + std::to_string(expected_begin));
      }
      fail(origin, where + " leave a gap of " + std::to_string(e.begin - expected_begin) +
                       " byte(s) after tensor " + printable(previous->name) + "'s " + range_str(*previous) +
                       "; expected it to begin at " + std::to_string(expected_begin));
    }
    expected_begin = e.end;
    previous = &e;
  }
  if (expected_begin != data_size) {
    fail(origin, "the data section is " + std::to_string(data_size) + " bytes but the tensors' data ends at " +
                     std::to_string(expected_begin) + "; expected no bytes after the last tensor" +
                     (previous ? " (" + printable(previous->name) + ")" : std::string(" (there are no tensors)")));
  }
}

// The header parsed as JSON: nesting bounded, a top-level key named twice refused, and the
// whole a JSON object.
json parse_header_json(const char* text, size_t length, const std::string& origin) {
  detail::check_json_nesting(text, length, kMaxJsonDepth, origin + ": header");
  // JSON objects keep the last of duplicate keys silently; a header naming a tensor twice is
  // ambiguous, so the top-level keys are checked while parsing.
  std::set<std::string> top_level_keys;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 &&
        !top_level_keys.insert(parsed.get<std::string>()).second) {
      fail(origin, "tensor " + printable(parsed.get<std::string>()) + " appears twice in the header");
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, text + length, on_event);
  } catch (const json::exception& e) {
    fail(origin, std::string("header is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) fail(origin, std::string("header must be a JSON object, got ") + j.type_name());
  return j;
}

// The "__metadata__" entry into `metadata`: an object whose every value is a string.
void read_metadata(const json& value, const std::string& origin, std::map<std::string, std::string>& metadata) {
  if (!value.is_object()) fail(origin, "__metadata__ must be an object of strings, got " + shown(value));
  for (auto m = value.begin(); m != value.end(); ++m) {
    if (!m.value().is_string()) {
      fail(origin, "__metadata__ key \"" + printable(m.key()) + "\" must be a string, got " +
                       shown(m.value()));
    }
    metadata[m.key()] = m.value().get<std::string>();
  }
}

// Tensor `name`'s "shape" into e.shape; returns its element count, checked to fit int64.
uint64_t read_shape(const json& value, const std::string& origin, const std::string& name, Entry& e) {
  auto shape = value.find("shape");
  if (shape == value.end() || !shape->is_array()) fail(origin, "tensor " + name + ": missing array \"shape\"");
  // Product of the dimensions (zeros counted as one) must fit int64, or torch would overflow.
  uint64_t bounded = 1, numel = 1;
  for (size_t i = 0; i < shape->size(); ++i) {
    const json& d = (*shape)[i];
    if (!d.is_number_unsigned()) {
      fail(origin, "tensor " + name + ": shape must hold non-negative integers, got " + shown(d) +
                       " at index " + std::to_string(i));
    }
    const uint64_t dim = d.get<uint64_t>();
    if (__builtin_mul_overflow(bounded, dim == 0 ? 1 : dim, &bounded) ||
        bounded > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(origin, "tensor " + name + ": shape is too large: dimension " + std::to_string(i) +
                       " = " + std::to_string(dim) + " takes the element count past 2^63 - 1");
    }
    numel *= dim;
    e.shape.push_back(static_cast<int64_t>(dim));
  }
  return numel;
}

// One tensor's entry (`key`: its name in the file): dtype, shape, and data_offsets that lie in
// the data section and span exactly the shape's bytes.
Entry read_entry(const std::string& key, const json& value, uint64_t data_size, const std::string& origin) {
  const std::string name = printable(key);  // for messages; the entry keeps the key itself
  if (!value.is_object()) fail(origin, "tensor " + name + ": entry must be an object, got " + shown(value));
  Entry e;
  e.name = key;

  auto dtype = value.find("dtype");
  if (dtype == value.end() || !dtype->is_string()) fail(origin, "tensor " + name + ": missing string \"dtype\"");
  e.dtype = parse_dtype(dtype->get<std::string>(), origin, name);

  const uint64_t numel = read_shape(value, origin, name, e);

  auto offsets = value.find("data_offsets");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2) {
    fail(origin, "tensor " + name + ": \"data_offsets\" must be [begin, end]");
  }
  e.begin = read_offset((*offsets)[0], origin, name);
  e.end = read_offset((*offsets)[1], origin, name);
  if (e.begin > e.end || e.end > data_size) {
    fail(origin, "tensor " + name + ": data_offsets [" + std::to_string(e.begin) + ", " +
                     std::to_string(e.end) + "] lie outside the data section of " +
                     std::to_string(data_size) + " bytes (truncated file?)");
  }
  const uint64_t itemsize = c10::elementSize(e.dtype);
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, itemsize, &nbytes) || nbytes != e.end - e.begin) {
    fail(origin, "tensor " + name + ": shape " + shape_str(e.shape) + " of " +
                     dtype_name(e.dtype) + " needs " + std::to_string(numel) + " x " +
                     std::to_string(itemsize) + " bytes but data_offsets span " +
                     std::to_string(e.end - e.begin));
  }
  return e;
}

// The header's metadata and its tensors in file order, every entry checked and the data section
// tiled by them.
Header parse_header(const char* text, size_t length, uint64_t data_size, const std::string& origin) {
  const json j = parse_header_json(text, length, origin);
  Header header;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      read_metadata(it.value(), origin, header.metadata);
      continue;
    }
    header.entries.push_back(read_entry(it.key(), it.value(), data_size, origin));
  }
  // The file's own order (what the writer wrote); JSON objects do not keep it.
  std::stable_sort(header.entries.begin(), header.entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  check_tiling(header.entries, data_size, origin);
  return header;
}

torch::Tensor empty_for(const Entry& e) {
  return torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
}

NamedTensors::value_type named(std::string name, torch::Tensor t) {
  return {std::move(name), std::move(t)};
}

}  // namespace

SafetensorsContents parse_safetensors(const uint8_t* data, size_t size, const std::string& origin) {
  if (size < 8) fail(origin, "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  const uint64_t header_len = check_header_length(read_u64_le(data), size, origin);
  const uint64_t data_size = size - 8 - header_len;
  Header header = parse_header(reinterpret_cast<const char*>(data + 8), header_len, data_size, origin);
  const uint8_t* base = data + 8 + header_len;
  SafetensorsContents contents;
  contents.metadata = std::move(header.metadata);
  for (const Entry& e : header.entries) {
    torch::Tensor t = empty_for(e);
    if (e.end > e.begin) std::memcpy(t.data_ptr(), base + e.begin, e.end - e.begin);
    contents.tensors.push_back(named(e.name, std::move(t)));
  }
  return contents;
}

// ----- reading a file on demand --------------------------------------------------------------

namespace {

// Reads exactly `n` bytes at `offset` (pread may return fewer); false when the file ends first.
bool read_exactly(int fd, void* out, uint64_t n, uint64_t offset) {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, static_cast<char*>(out) + done, n - done, static_cast<off_t>(offset + done));
    if (got <= 0) return false;
    done += static_cast<uint64_t>(got);
  }
  return true;
}

}  // namespace

struct SafetensorsReader::State {
  std::string path;
  int fd = -1;
  uint64_t data_start = 0;  // 8 + header length
  Header header;
  std::map<std::string, size_t> index;  // name -> entry
  std::vector<TensorInfo> infos;
  uint64_t bytes_read = 0;

  ~State() {
    if (fd >= 0) ::close(fd);
  }
  const Entry& entry(const std::string& name) const {
    auto it = index.find(name);
    if (it == index.end()) fail(path, "no tensor " + printable(name) + " in the file");
    return header.entries[it->second];
  }
  // `n` bytes at data offset `offset` of entry `e` into `out`.
  void read(const Entry& e, uint64_t offset, uint64_t n, void* out) {
    if (!read_exactly(fd, out, n, data_start + e.begin + offset)) {
      fail(path, "tensor " + printable(e.name) + ": read of its data failed (file changed or truncated?)");
    }
    bytes_read += n;
  }
};

SafetensorsReader::SafetensorsReader(const std::string& path) : state_(std::make_unique<State>()) {
  State& st = *state_;
  st.path = path;
  st.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (st.fd < 0) fail(path, std::string("cannot open safetensors file: ") + std::strerror(errno));
  const off_t end = ::lseek(st.fd, 0, SEEK_END);  // fails on a pipe or a seq_file (/proc)
  if (end < 0) {
    fail(path, "cannot determine the file size (not a regular file: a pipe or a special file?); "
               "expected a seekable safetensors file");
  }
  const uint64_t size = static_cast<uint64_t>(end);
  if (size < 8) fail(path, "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint8_t prefix[8];
  if (!read_exactly(st.fd, prefix, 8, 0)) fail(path, "cannot read the 8-byte header length");
  const uint64_t header_len = check_header_length(read_u64_le(prefix), size, path);
  std::string text(header_len, '\0');
  if (!read_exactly(st.fd, text.data(), header_len, 8)) fail(path, "cannot read the header");
  st.header = parse_header(text.data(), text.size(), size - 8 - header_len, path);
  st.data_start = 8 + header_len;
  for (size_t i = 0; i < st.header.entries.size(); ++i) {
    const Entry& e = st.header.entries[i];
    st.index[e.name] = i;
    st.infos.push_back({e.name, e.dtype, e.shape});
  }
}

SafetensorsReader::~SafetensorsReader() = default;

const std::vector<SafetensorsReader::TensorInfo>& SafetensorsReader::tensors() const { return state_->infos; }
const std::map<std::string, std::string>& SafetensorsReader::metadata() const { return state_->header.metadata; }
uint64_t SafetensorsReader::bytes_read() const { return state_->bytes_read; }

torch::Tensor SafetensorsReader::read(const std::string& name) {
  const Entry& e = state_->entry(name);
  torch::Tensor t = empty_for(e);
  if (e.end > e.begin) state_->read(e, 0, e.end - e.begin, t.data_ptr());
  return t;
}

torch::Tensor SafetensorsReader::read_ranges(const std::string& name, int64_t dim,
                                             const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  const Entry& e = state_->entry(name);
  const int64_t dims = static_cast<int64_t>(e.shape.size());
  if (dims < 1 || dims > 2 || (dim != 0 && dim != dims - 1)) {
    fail(state_->path, "tensor " + printable(name) + " of shape " + shape_str(e.shape) +
                           ": only the first or last dimension of a 1- or 2-dimensional tensor can be read in ranges");
  }
  int64_t total = 0;
  for (const auto& [start, length] : ranges) {
    if (start < 0 || length < 0 || start + length > e.shape[dim]) {
      fail(state_->path, "tensor " + printable(name) + ": range [" + std::to_string(start) + ", " +
                             std::to_string(start + length) + ") is outside dimension " + std::to_string(dim) +
                             " of shape " + shape_str(e.shape));
    }
    total += length;
  }
  std::vector<int64_t> shape = e.shape;
  shape[dim] = total;
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(e.dtype));
  const uint64_t element = static_cast<uint64_t>(t.element_size());
  char* out = static_cast<char*>(t.data_ptr());
  if (dim == 0) {  // whole rows: one contiguous read per range
    const uint64_t row = (dims == 2 ? static_cast<uint64_t>(e.shape[1]) : 1) * element;
    for (const auto& [start, length] : ranges) {
      state_->read(e, static_cast<uint64_t>(start) * row, static_cast<uint64_t>(length) * row, out);
      out += static_cast<uint64_t>(length) * row;
    }
  } else {  // columns of a matrix: one read per row and range
    const uint64_t rows = static_cast<uint64_t>(e.shape[0]), columns = static_cast<uint64_t>(e.shape[1]);
    for (uint64_t r = 0; r < rows; ++r) {
      for (const auto& [start, length] : ranges) {
        state_->read(e, (r * columns + static_cast<uint64_t>(start)) * element, static_cast<uint64_t>(length) * element, out);
        out += static_cast<uint64_t>(length) * element;
      }
    }
  }
  return t;
}

SafetensorsContents read_safetensors_with_metadata(const std::string& path) {
  SafetensorsReader file(path);
  SafetensorsContents contents;
  contents.metadata = file.metadata();
  for (const auto& info : file.tensors()) contents.tensors.push_back(named(info.name, file.read(info.name)));
  return contents;
}

NamedTensors read_safetensors(const std::string& path) {
  return read_safetensors_with_metadata(path).tensors;
}

// ----- writing -------------------------------------------------------------------------------

struct SafetensorsWriter::State {
  std::string path, tmp;
  std::vector<SafetensorsEntry> entries;
  size_t next = 0;
  std::ofstream out;
  bool finished = false;
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  st.path = path;
  st.tmp = path + ".tmp";
  json header = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.name == "__metadata__") fail(path, "a tensor may not be called __metadata__");
    if (header.contains(e.name)) fail(path, "tensor " + e.name + " is given twice");
    if (e.dtype != torch::kFloat && e.dtype != torch::kHalf && e.dtype != torch::kBFloat16) {
      fail(path, "tensor " + e.name + " has dtype " + std::string(c10::toString(e.dtype)) +
                     "; only float32, float16 and bfloat16 are written");
    }
    uint64_t n = c10::elementSize(e.dtype);
    for (int64_t d : e.shape) n *= static_cast<uint64_t>(d);
    header[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // type_error 316: a name or metadata that is not UTF-8
    fail(path, std::string("cannot encode the header: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  st.entries = std::move(entries);
  st.out.open(st.tmp, std::ios::binary | std::ios::trunc);
  if (!st.out) fail(st.tmp, "cannot open for writing");
  uint8_t prefix[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8) prefix[i] = static_cast<uint8_t>(n & 0xff);
  st.out.write(reinterpret_cast<const char*>(prefix), 8);
  st.out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (state_ && !state_->finished) {
    state_->out.close();
    ::unlink(state_->tmp.c_str());
  }
}

void SafetensorsWriter::append(const torch::Tensor& tensor) {
  State& st = *state_;
  if (st.next >= st.entries.size()) fail(st.path, "more tensors appended than the header lists");
  const SafetensorsEntry& e = st.entries[st.next];
  if (!tensor.defined()) fail(st.path, "tensor " + e.name + " is undefined");
  if (tensor.scalar_type() != e.dtype || tensor.sizes() != at::IntArrayRef(e.shape)) {
    fail(st.path, "tensor " + e.name + " is " + std::string(c10::toString(tensor.scalar_type())) +
                      shape_str(tensor.sizes()) + ", the header says " + std::string(c10::toString(e.dtype)) +
                      shape_str(e.shape));
  }
  const torch::Tensor t = tensor.detach().to(torch::kCPU).contiguous();
  st.out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
  if (!st.out) fail(st.tmp, "write failed (disk full?)");
  ++st.next;
}

void SafetensorsWriter::finish() {
  State& st = *state_;
  if (st.next != st.entries.size()) {
    fail(st.path, std::to_string(st.entries.size() - st.next) + " of the header's tensors were not appended");
  }
  if (!st.out.flush()) fail(st.tmp, "write failed (disk full?)");
  st.out.close();
  std::error_code ec;
  std::filesystem::rename(st.tmp, st.path, ec);
  if (ec) fail(st.path, "cannot move " + st.tmp + " into place: " + ec.message());
  st.finished = true;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) fail(path, "tensor " + name + " is undefined");
    entries.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  SafetensorsWriter writer(path, std::move(entries), metadata);
  for (const auto& [name, tensor] : tensors) writer.append(tensor);
  writer.finish();
}

void load_pretrained(GPT2LMHeadModelImpl& model, const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "model.safetensors").string();
  const std::string& origin = path;
  SafetensorsReader file(path);
  const auto& shards = model.shards();

  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  std::map<std::string, std::string> stored_as;  // parameter -> the file's name for it
  bool has_lm_head = false;
  for (const auto& info : file.tensors()) {
    const std::string& raw_name = info.name;
    if (ends_with(raw_name, ".attn.bias") || ends_with(raw_name, ".attn.masked_bias")) continue;
    if (raw_name == "lm_head.weight") {
      has_lm_head = true;
      continue;
    }
    const std::string name = raw_name.rfind("transformer.", 0) == 0 ? raw_name : "transformer." + raw_name;
    auto shard = shards.find(name);
    if (shard == shards.end()) {
      fail(origin, "tensor " + printable(raw_name) + " is not a parameter of this model (n_layer " +
                       std::to_string(model.config().n_layer) + "; config.json and weights disagree?)");
    }
    if (stored_as.count(name)) fail(origin, "tensor " + printable(name) + " is given twice (with and without \"transformer.\")");
    if (at::IntArrayRef(info.shape) != at::IntArrayRef(shard->second.full_shape)) {
      fail(origin, "tensor " + name + " has shape " + shape_str(info.shape) + ", expected " +
                       shape_str(shard->second.full_shape));
    }
    stored_as.emplace(name, raw_name);
  }
  std::vector<std::string> missing;
  for (auto& item : model.named_parameters()) {
    if (!stored_as.count(item.key())) missing.push_back(item.key());
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size(); ++i) {
      if (i == 8) {
        list += ", ... (" + std::to_string(missing.size()) + " in all)";
        break;
      }
      list += (i ? ", " : "") + missing[i];
    }
    fail(origin, std::to_string(missing.size()) + " tensor(s) missing: " + list);
  }
  if (has_lm_head) {
    const torch::Tensor lm_head = file.read("lm_head.weight").to(torch::kFloat);
    const torch::Tensor wte = file.read(stored_as.at("transformer.wte.weight")).to(torch::kFloat);
    if (lm_head.sizes() != wte.sizes() || !torch::equal(lm_head, wte)) {
      fail(origin, "lm_head.weight differs from transformer.wte.weight; untied LM heads are not supported");
    }
  }
  // Split over a tensor-parallel group, each rank reads its own slices alone.
  const TensorParallelGroup* tp = model.tensor_parallel();
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    const std::string& stored = stored_as.at(item.key());
    const ShardSpec& spec = shards.at(item.key()).spec;
    torch::Tensor local;
    if (tp == nullptr || spec.kind == ShardSpec::Kind::kReplicated) {
      local = file.read(stored);
    } else {
      const auto& full_shape = shards.at(item.key()).full_shape;
      const int64_t dim = spec.split_dim(static_cast<int64_t>(full_shape.size()));
      local = file.read_ranges(stored, dim, shard_ranges(full_shape[dim], spec, tp->rank(), tp->size()));
    }
    item.value().copy_(local.to(torch::kFloat).to(item.value().scalar_type()));
  }
}

GPT2LMHeadModel from_pretrained(const std::string& dir) {
  const auto config = GPT2Config::from_json_file((std::filesystem::path(dir) / "config.json").string());
  GPT2LMHeadModel model(config);
  load_pretrained(*model, dir);
  return model;
}

void write_model_weights(GPT2LMHeadModelImpl& model, const std::string& path, bool write) {
  if (!write && model.tensor_parallel() == nullptr) return;  // nothing to gather, nothing to write
  std::unique_ptr<SafetensorsWriter> file;
  if (write) {
    std::vector<SafetensorsEntry> entries;
    for (const auto& item : model.named_parameters()) {
      entries.push_back({item.key(), item.value().scalar_type(), model.shards().at(item.key()).full_shape});
    }
    file = std::make_unique<SafetensorsWriter>(path, std::move(entries));
  }
  model.for_each_full(/*gradients=*/false, [&](const std::string&, const torch::Tensor& full) {
    if (file) file->append(full);
  });
  if (file) file->finish();
}

void save_pretrained(GPT2LMHeadModelImpl& model, const std::string& dir, bool write) {
  if (write) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) fail(dir, "cannot create directory: " + ec.message());
    model.config().save_json_file((std::filesystem::path(dir) / "config.json").string());
  }
  write_model_weights(model, (std::filesystem::path(dir) / "model.safetensors").string(), write);
}

}  // namespace harness::model
