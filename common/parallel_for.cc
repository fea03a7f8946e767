#include "common/parallel_for.h"

#include <exception>
#include <thread>
#include <vector>

namespace psflow {

void ParallelFor(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(n > 1 ? n - 1 : 0);
  int started = 1;  // fn(1) to fn(started - 1) have threads
  for (; started < n; ++started) {
    try {
      threads.emplace_back([&fn, i = started] { fn(i); });
    } catch (const std::exception&) {  // std::system_error, or std::bad_alloc
      break;
    }
  }
  for (int i = 0; i < n; ++i) {
    if (i == 0 || i >= started) fn(i);
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace psflow
