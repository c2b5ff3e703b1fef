// Runs fuzz inputs through tests/fuzz/fuzz_api.cpp's LLVMFuzzerTestOneInput without libFuzzer or a sanitizer:
// the seed corpus against the installed-style library (meson's build), so that valgrind memcheck sees every
// entry point with valid and invalid arguments (tools/sanitizers.sh valgrind). The oracles are the harness's
// own; a failure aborts, as under libFuzzer.
//
//   fuzz_replay PATH...   each PATH a fuzz input or a folder of them (its files in name order)
//
// Exit status 0 when every input ran; 2 when a path cannot be read or no input was found.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool read_file(const std::string& path, std::vector<uint8_t>* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return !f.bad();
}

bool list(const std::string& path, std::vector<std::string>* files) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return false;
  if (!S_ISDIR(st.st_mode)) {
    files->push_back(path);
    return true;
  }
  DIR* d = opendir(path.c_str());
  if (!d) return false;
  std::vector<std::string> names;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') names.push_back(path + "/" + e->d_name);
  closedir(d);
  std::sort(names.begin(), names.end());
  files->insert(files->end(), names.begin(), names.end());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i)
    if (!list(argv[i], &files)) {
      std::fprintf(stderr, "fuzz_replay: cannot read %s\n", argv[i]);
      return 2;
    }
  if (files.empty()) {
    std::fprintf(stderr, "usage: fuzz_replay PATH... (fuzz inputs or folders of them); no input found\n");
    return 2;
  }
  std::vector<uint8_t> data;
  for (const std::string& f : files) {
    if (!read_file(f, &data)) {
      std::fprintf(stderr, "fuzz_replay: cannot read %s\n", f.c_str());
      return 2;
    }
    LLVMFuzzerTestOneInput(data.data(), data.size());
  }
  std::fprintf(stderr, "fuzz_replay: %zu inputs run\n", files.size());
  return 0;
}
