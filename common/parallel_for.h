// ParallelFor: runs a few independent pieces of work on threads of their
// own, degrading to the calling thread where no thread can be started.
#ifndef PSFLOW_COMMON_PARALLEL_FOR_H_
#define PSFLOW_COMMON_PARALLEL_FOR_H_

#include <functional>

namespace psflow {

// Runs fn(i) for i in [0, n) in parallel, i = 0 on the calling thread, and
// returns when all have returned. When a thread cannot be started (a pid
// or memory limit), the i without one run on the calling thread too, one
// after another: slower, with the same results, instead of std::thread's
// exception ending the process. For a handful of long pieces (a thread is
// started for each, tens of microseconds), not a pool.
void ParallelFor(int n, const std::function<void(int)>& fn);

}  // namespace psflow

#endif  // PSFLOW_COMMON_PARALLEL_FOR_H_
