// Retry with capped exponential backoff and jitter, for calls that failed
// with a transient status (UNAVAILABLE, DEADLINE_EXCEEDED).
#ifndef PSFLOW_COMMON_RETRY_H_
#define PSFLOW_COMMON_RETRY_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace psflow {

struct RetryOptions {
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(5);
  double multiplier = 2.0;
  double jitter = 0.2;     // each wait is scaled by a factor in [1-jitter, 1+jitter]
  int max_attempts = 10;   // attempts in all, the first included
  // Attempts that may end in DEADLINE_EXCEEDED, the first included. Each one
  // waited its whole deadline for a peer that did not answer (hung, or cut
  // off without a reset), so ten of them took ten deadlines (10 minutes at
  // the worker's 60 s) to report a hung shard; a refused connection
  // (UNAVAILABLE) fails at once and keeps the full max_attempts.
  int max_deadline_attempts = 2;
  // No retry starts later than this after the first attempt began (the
  // first attempt always runs). For a call whose retries are safe only for
  // a while: a push's request id is remembered by the shard for a limited
  // time. `window_reason`, if set, ends the error of a call stopped by it.
  absl::Duration retry_window = absl::InfiniteDuration();
  std::string window_reason;
};

// OK, or INVALID_ARGUMENT naming the first setting that would make the
// waits meaningless: a backoff below 0, infinite or above max_backoff, a
// multiplier outside [1, 1e9), a jitter outside [0, 1) (at 1 or more a wait
// can be 0 or negative, and retries spin).
absl::Status CheckRetryOptions(const RetryOptions& options);

// True for the codes worth retrying: UNAVAILABLE and DEADLINE_EXCEEDED.
bool IsRetryable(const absl::Status& status);

// Backoff schedule of one logical call. Not thread-safe.
class Backoff {
 public:
  explicit Backoff(const RetryOptions& options);
  // The wait before the next attempt; grows by `multiplier` up to
  // `max_backoff`, with jitter.
  absl::Duration Next();

 private:
  RetryOptions options_;
  absl::Duration current_;
  absl::BitGen gen_;
};

// Told of each retry before its wait: the status the last attempt failed
// with, the number of the attempt to come (2 for the first retry), the most
// attempts the call may make, and the wait before it.
using RetryObserver = std::function<void(const absl::Status& failed, int next_attempt,
                                         int max_attempts, absl::Duration wait)>;

// Runs `attempt` until it succeeds, fails with a non-retryable status, or
// `max_attempts` are spent (or `max_deadline_attempts` ended in
// DEADLINE_EXCEEDED), or another would start past `retry_window`; waits
// per Backoff between attempts, by sleeping or, where given, by calling
// `wait_for` with the backoff (a gRPC client watches its channels there, so
// that their reconnection goes on meanwhile; it should return after about
// that long). No attempt starts past `retry_window`, checked before each
// wait and after it. `observe`, where given, hears of each retry before
// its wait. The final error says how many attempts were made.
absl::Status RetryCall(const RetryOptions& options, const std::function<absl::Status()>& attempt,
                       const std::function<void(absl::Duration)>& wait_for = nullptr,
                       const RetryObserver& observe = nullptr);

// `message` without the account of the attempts that RetryCall adds to a
// final error (" (gave up after 3 attempts...)"): for a caller that goes
// on waiting, to whom "gave up" would say the opposite.
absl::string_view WithoutRetrySummary(absl::string_view message);

}  // namespace psflow

#endif  // PSFLOW_COMMON_RETRY_H_
