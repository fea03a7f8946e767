#include "common/process_stats.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace psflow {

int64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long pages_total = 0, pages_resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &pages_total, &pages_resident);
  std::fclose(f);
  if (n != 2) return 0;
  return static_cast<int64_t>(pages_resident) * sysconf(_SC_PAGESIZE);
}

int64_t PeakResidentBytes() {
  // The kernel updates its high-water mark only now and then (when it
  // syncs the counters), so it can lag behind the resident size just read
  // from statm: a peak below the current size was reported.
  struct rusage usage;
  const int64_t peak =
      getrusage(RUSAGE_SELF, &usage) == 0 ? static_cast<int64_t>(usage.ru_maxrss) * 1024 : 0;
  return std::max(peak, ResidentBytes());
}

namespace {

// The first line of `path` as a positive number of bytes; 0 for "max", an
// unreadable file, or v1's "no limit" (a value near INT64_MAX).
int64_t ReadLimitFile(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return 0;
  int64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &value) || value <= 0) return 0;
  if (value >= (int64_t{1} << 60)) return 0;
  return value;
}

}  // namespace

namespace internal {

int64_t CgroupMemoryLimit(const std::string& proc_self_cgroup, const std::string& cgroup_root) {
  // Lines are "hierarchy-id:controllers:path": "0::/path" for cgroup v2,
  // "N:memory:/path" (among others) for v1. A limit set on an ancestor
  // applies too, so the smallest one on the way up counts.
  int64_t best = 0;
  auto consider = [&best](int64_t limit) {
    if (limit > 0 && (best == 0 || limit < best)) best = limit;
  };
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    std::string dir, file;
    if (fields[0] == "0" && fields[1].empty()) {
      dir = cgroup_root;
      file = "memory.max";
    } else if (absl::StrContains(fields[1], "memory")) {
      dir = cgroup_root + "/memory";
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    std::string path(fields[2]);
    // Walk from the process's own cgroup up to the root of the mount. In a
    // container the path may name the host's hierarchy, which is not
    // mounted there: missing files simply count as no limit.
    while (true) {
      consider(ReadLimitFile(dir + (path == "/" ? "" : path) + "/" + file));
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return best;
}

}  // namespace internal

int64_t MemoryLimitBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  int64_t limit = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  const int64_t cgroup = internal::CgroupMemoryLimit(text.str(), "/sys/fs/cgroup");
  if (cgroup > 0 && (limit == 0 || cgroup < limit)) limit = cgroup;
  return limit;
}

void TuneAllocatorForLargeMessages() {
  // Serve chunk-sized blocks (up to 32 MiB) from the heap rather than fresh
  // mmaps, and do not trim the heap below 256 MiB of free space. One arena:
  // with an arena per gRPC thread each kept its own freed message buffers
  // (a 1-shard PS held 105-118 MB for 33 MB of parameters and Adam slots;
  // 75 MB with one arena, at the same push/pull speed).
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

}  // namespace psflow
