// glibc's malloc tuned to keep freed host memory (see host_memory.h).
#include "harness/host_memory.h"

#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace harness {
namespace {

// The bytes of a "<key> <n> kB" line of a /proc file; -1 where there is none or it cannot be read.
int64_t kilobytes_field(const char* path, const std::string& key) {
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind(key, 0) != 0) continue;
    std::istringstream fields(line.substr(key.size()));
    int64_t kilobytes = -1;
    std::string unit;
    fields >> kilobytes >> unit;
    return kilobytes < 0 || unit != "kB" ? -1 : kilobytes * 1024;
  }
  return -1;
}

}  // namespace

void keep_freed_host_memory() {
  const char* setting = std::getenv("HARNESS_KEEP_FREED_MEMORY");
  if (setting != nullptr && std::strcmp(setting, "0") == 0) return;
#if defined(__GLIBC__)
  ::mallopt(M_MMAP_MAX, 0);              // no allocation gets its own mapping
  ::mallopt(M_TRIM_THRESHOLD, INT_MAX);  // freed memory at the heap's top is not given back
#endif
}

int64_t give_back_freed_host_memory() {
  const int64_t before = resident_memory_bytes();
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
  const int64_t after = resident_memory_bytes();
  return before < 0 || after < 0 || after > before ? 0 : before - after;
}

int64_t resident_memory_bytes() { return kilobytes_field("/proc/self/status", "VmRSS:"); }

int64_t host_available_memory_bytes() { return kilobytes_field("/proc/meminfo", "MemAvailable:"); }

}  // namespace harness
