#include "common/process_stats.h"

#include <malloc.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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
namespace {

// The smallest positive value `read` finds on the way from the process's
// own cgroup up to the root of the mount: a limit set on an ancestor
// applies too. `read(dir, v2)` reads one directory's files, of the v2
// hierarchy or of v1's `v1_controller` one; 0 there means no limit.
template <typename T, typename Read>
T SmallestOnTheWayUp(const std::string& proc_self_cgroup, const std::string& cgroup_root,
                     absl::string_view v1_controller, Read read) {
  // Lines are "hierarchy-id:controllers:path": "0::/path" for cgroup v2,
  // "N:memory:/path" or "N:cpu,cpuacct:/path" (among others) for v1.
  T best = 0;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    const bool v2 = fields[0] == "0" && fields[1].empty();
    std::string dir;
    if (v2) {
      dir = cgroup_root;
    } else if (absl::c_linear_search(absl::StrSplit(fields[1], ','), v1_controller)) {
      dir = absl::StrCat(cgroup_root, "/", v1_controller);
    } else {
      continue;
    }
    std::string path(fields[2]);
    // In a container the path may name the host's hierarchy, which is not
    // mounted there: missing files simply count as no limit.
    while (true) {
      const T limit = read(dir + (path == "/" ? "" : path), v2);
      if (limit > 0 && (best == 0 || limit < best)) best = limit;
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return best;
}

// The first line of `path`; empty if it cannot be read.
std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return std::string(absl::StripAsciiWhitespace(line));
}

}  // namespace

int64_t CgroupMemoryLimit(const std::string& proc_self_cgroup, const std::string& cgroup_root) {
  return SmallestOnTheWayUp<int64_t>(
      proc_self_cgroup, cgroup_root, "memory", [](const std::string& dir, bool v2) {
        return ReadLimitFile(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
      });
}

double CgroupCpuLimit(const std::string& proc_self_cgroup, const std::string& cgroup_root) {
  return SmallestOnTheWayUp<double>(
      proc_self_cgroup, cgroup_root, "cpu", [](const std::string& dir, bool v2) {
        // v2: cpu.max holds "QUOTA PERIOD" or "max PERIOD"; v1 keeps them
        // apart, with a quota of -1 for none.
        std::string quota_text, period_text;
        if (v2) {
          const std::vector<std::string> fields =
              absl::StrSplit(FirstLine(dir + "/cpu.max"), ' ', absl::SkipEmpty());
          if (fields.size() != 2) return 0.0;
          quota_text = fields[0];
          period_text = fields[1];
        } else {
          quota_text = FirstLine(dir + "/cpu.cfs_quota_us");
          period_text = FirstLine(dir + "/cpu.cfs_period_us");
        }
        int64_t quota = 0, period = 0;
        if (!absl::SimpleAtoi(quota_text, &quota) || !absl::SimpleAtoi(period_text, &period) ||
            quota <= 0 || period <= 0) {
          return 0.0;
        }
        return static_cast<double>(quota) / static_cast<double>(period);
      });
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

namespace {

// An OpenMP runtime told to bind its threads pins the process's first
// thread to one place as it loads, before main runs (libgomp, which oneDNN
// uses, does): that thread's affinity mask then no longer says which cores
// the process may use.
bool OpenMpBindsThreads() {
  for (const char* name : {"OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return true;
  }
  const char* bind = std::getenv("OMP_PROC_BIND");
  return bind != nullptr && *bind != '\0' && !absl::EqualsIgnoreCase(bind, "false");
}

}  // namespace

int UsableCores() {
  int cores = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  // Fails beyond CPU_SETSIZE (1024) cores: then all of them count.
  if (!OpenMpBindsThreads() && sched_getaffinity(0, sizeof(set), &set) == 0) {
    cores = CPU_COUNT(&set);
  }
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  const double quota = internal::CgroupCpuLimit(text.str(), "/sys/fs/cgroup");
  // Whole cores: a thread more than the quota holds would wait out each
  // period's throttling, and a team of threads waits for its slowest.
  if (quota > 0) cores = std::min(cores, static_cast<int>(std::floor(quota + 1e-6)));
  return std::max(1, cores);
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
