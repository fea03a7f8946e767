// Process-level numbers the servers report and respect: resident memory, and
// the memory and the cores this process may use.
#ifndef PSFLOW_COMMON_PROCESS_STATS_H_
#define PSFLOW_COMMON_PROCESS_STATS_H_

#include <cstdint>
#include <string>

namespace psflow {

// Resident set size of this process in bytes (from /proc/self/statm); 0 if
// unknown.
int64_t ResidentBytes();
// Peak resident set size in bytes (getrusage), at least ResidentBytes();
// 0 if unknown.
int64_t PeakResidentBytes();
// The most memory this process may use, in bytes: the smaller of the
// machine's RAM and the memory limit of the process's cgroup (cgroup v2
// `memory.max`, or v1 `memory.limit_in_bytes`; a container's or Kubernetes
// pod's limit). 0 if neither is known.
int64_t MemoryLimitBytes();
// The cores this process may keep busy: those its CPU affinity allows
// (taskset, a cpuset), at most the whole cores of its cgroup's CPU quota
// (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`; a container's or Kubernetes
// pod's CPU limit), and at least 1. std::thread::hardware_concurrency counts
// every core of the machine instead. Where OMP_PROC_BIND, OMP_PLACES (or
// GOMP_CPU_AFFINITY, KMP_AFFINITY) make OpenMP pin the first thread, its
// mask is not read and every core counts, up to the quota.
int UsableCores();
// Keeps large freed buffers in the heap instead of returning them to the OS,
// so message-sized allocations on the hot path do not page-fault afresh each
// time (first touch costs ~12 us per 4 KiB page on these machines), and keeps
// one malloc arena. Call once at the start of main, before any thread starts.
void TuneAllocatorForLargeMessages();

namespace internal {
// The cgroup memory limit found under `cgroup_root` (normally /sys/fs/cgroup)
// for a process whose /proc/self/cgroup reads `proc_self_cgroup`; 0 if there
// is none. Exposed for tests.
int64_t CgroupMemoryLimit(const std::string& proc_self_cgroup, const std::string& cgroup_root);
// The CPU quota in cores (quota / period, e.g. 2.5) found the same way, the
// smallest on the way up; 0 if there is none.
double CgroupCpuLimit(const std::string& proc_self_cgroup, const std::string& cgroup_root);
}  // namespace internal

}  // namespace psflow

#endif  // PSFLOW_COMMON_PROCESS_STATS_H_
