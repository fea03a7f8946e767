// Process-level numbers the servers report: resident memory.
#ifndef PSFLOW_COMMON_PROCESS_STATS_H_
#define PSFLOW_COMMON_PROCESS_STATS_H_

#include <cstdint>

namespace psflow {

// Resident set size of this process in bytes (from /proc/self/statm); 0 if
// unknown.
int64_t ResidentBytes();
// Peak resident set size in bytes (getrusage); 0 if unknown.
int64_t PeakResidentBytes();
// Keeps large freed buffers in the heap instead of returning them to the OS,
// so message-sized allocations on the hot path do not page-fault afresh each
// time (first touch costs ~12 us per 4 KiB page on these machines), and keeps
// one malloc arena. Call once at the start of main, before any thread starts.
void TuneAllocatorForLargeMessages();

}  // namespace psflow

#endif  // PSFLOW_COMMON_PROCESS_STATS_H_
