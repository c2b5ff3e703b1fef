#include "common/force_path.hpp"

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"

namespace fce {

namespace {

using Pairs = std::vector<std::pair<std::string, std::string>>;

Pairs parse(const std::string& s) {
  Pairs v;
  for (size_t at = 0; at < s.size();) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(at, end - at);
    const size_t colon = item.find(':');
    if (colon != std::string::npos) v.emplace_back(item.substr(0, colon), item.substr(colon + 1));
    at = end + 1;
  }
  return v;
}

// FCE_FORCE_PATH's (op, path) pairs, parsed again when the variable changes (a process may switch paths
// between calls; the cache is per thread, so threads with handles of their own need no lock).
const Pairs& forced() {
  thread_local std::string raw;
  thread_local Pairs pairs;
  const char* e = std::getenv("FCE_FORCE_PATH");
  const char* now = e ? e : "";
  if (raw != now) {
    raw = now;
    pairs = parse(raw);
  }
  return pairs;
}

}  // namespace

int forced_path(const char* op, const char* const* names, size_t count) {
  for (const auto& [o, path] : forced()) {
    if (o != op) continue;
    for (size_t i = 0; i < count; ++i)
      if (path == names[i]) return int(i);
    std::string known;
    for (size_t i = 0; i < count; ++i) known += std::string(i ? ", " : "") + names[i];
    raise(FCE_STATUS_INVALID_ARGUMENT, "FCE_FORCE_PATH names path '%s' of %s, whose paths are: %s", path.c_str(), op,
          known.c_str());
  }
  return -1;
}

}  // namespace fce
