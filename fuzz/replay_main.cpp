// Replays fuzz inputs without libFuzzer (seeds and past crashes as ordinary tests): calls
// LLVMFuzzerTestOneInput on each file named, and on each file directly inside each folder named.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// The files to replay for one argument, sorted; an empty list when it names nothing readable.
std::vector<std::string> inputs_of(const std::string& arg) {
  struct stat info;
  if (::stat(arg.c_str(), &info) != 0) return {};
  if (!S_ISDIR(info.st_mode)) return {arg};
  std::vector<std::string> files;
  if (DIR* dir = ::opendir(arg.c_str())) {
    while (const dirent* entry = ::readdir(dir)) {
      const std::string path = arg + "/" + entry->d_name;
      if (entry->d_name[0] != '.' && ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode)) {
        files.push_back(path);
      }
    }
    ::closedir(dir);
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_FOLDER...  (replays each input once)\n", argv[0]);
    return 2;
  }
  size_t replayed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::vector<std::string> files = inputs_of(argv[i]);
    if (files.empty()) {
      std::fprintf(stderr, "%s: no such file, or a folder without inputs\n", argv[i]);
      return 1;
    }
    for (const std::string& file : files) {
      std::ifstream in(file, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "%s: cannot open\n", file.c_str());
        return 1;
      }
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::fprintf(stderr, "replaying %s (%zu bytes)\n", file.c_str(), bytes.size());
      bytes.reserve(1);  // libFuzzer never passes a null pointer, not even for an empty input
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  std::printf("replayed %zu input(s) without a crash\n", replayed);
  return 0;
}
