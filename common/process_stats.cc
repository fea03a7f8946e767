#include "common/process_stats.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>

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
  struct rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
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
