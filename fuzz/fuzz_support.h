// Shared by the fuzz targets: the one accepted way for a reader to reject an input (a
// std::runtime_error), and scratch files for the readers that only take a path.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <typeinfo>

namespace harness::fuzz {

// Runs `parse` and returns its result, or nothing when it rejects the input with a
// std::runtime_error (the documented way). Any other exception aborts, so that libFuzzer, or the
// replay test, reports the input. Checks of what was parsed belong outside `parse`.
template <typename Fn>
auto parsed_or_rejected(Fn&& parse) -> std::optional<decltype(parse())> {
  try {
    return parse();
  } catch (const std::runtime_error&) {
    return std::nullopt;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception %s: %s\n", typeid(e).name(), e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "unexpected exception of a type not derived from std::exception\n");
    std::abort();
  }
}

// A property of an accepted input; aborts naming it when it does not hold.
inline void require(bool holds, const char* property) {
  if (!holds) {
    std::fprintf(stderr, "property violated: %s\n", property);
    std::abort();
  }
}

namespace detail {
struct Scratch {
  std::string dir;
  std::set<std::string> files;
  ~Scratch() {  // runs at exit: leave nothing behind (no std::filesystem::remove_all with libtorch)
    for (const std::string& file : files) ::unlink(file.c_str());
    if (!dir.empty()) ::rmdir(dir.c_str());
  }
};
inline Scratch& scratch() {
  static Scratch instance;
  return instance;
}
}  // namespace detail

// A private folder, made once per process under $TMPDIR, else /dev/shm (memory), else /tmp.
inline const std::string& scratch_dir() {
  detail::Scratch& s = detail::scratch();
  if (s.dir.empty()) {
    const char* env = std::getenv("TMPDIR");
    struct stat info;
    std::string base = env && *env ? env : (::stat("/dev/shm", &info) == 0 ? "/dev/shm" : "/tmp");
    std::string pattern = base + "/harness_fuzz_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror(("fuzz: mkdtemp " + pattern).c_str());
      std::abort();
    }
    s.dir = pattern;
  }
  return s.dir;
}

// Writes the input to scratch_dir()/name (replacing it) and returns that path.
inline std::string write_scratch(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  detail::scratch().files.insert(path);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::perror(("fuzz: open " + path).c_str());
    std::abort();
  }
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) {
      std::perror(("fuzz: write " + path).c_str());
      std::abort();
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return path;
}

}  // namespace harness::fuzz
