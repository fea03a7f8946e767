#include "common/retry.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace psflow {

absl::Status CheckRetryOptions(const RetryOptions& options) {
  const absl::Duration initial = options.initial_backoff, cap = options.max_backoff;
  if (cap < absl::ZeroDuration() || cap == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("retry: max_backoff is ",
                                                   absl::FormatDuration(cap),
                                                   "; expected a finite wait of 0 or more"));
  }
  if (initial < absl::ZeroDuration() || initial > cap) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry: initial_backoff is ", absl::FormatDuration(initial),
                     "; expected 0 to max_backoff (", absl::FormatDuration(cap), ")"));
  }
  if (!(options.multiplier >= 1.0 && options.multiplier < 1e9)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry: multiplier is ", options.multiplier, "; expected 1 to 1e9"));
  }
  if (!(options.jitter >= 0.0 && options.jitter < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry: jitter is ", options.jitter,
                     "; expected at least 0 and below 1 (each wait is scaled by a factor in "
                     "[1-jitter, 1+jitter])"));
  }
  return absl::OkStatus();
}

bool IsRetryable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

Backoff::Backoff(const RetryOptions& options)
    : options_(options), current_(options.initial_backoff) {}

absl::Duration Backoff::Next() {
  const double factor =
      options_.jitter > 0 ? absl::Uniform(gen_, 1.0 - options_.jitter, 1.0 + options_.jitter) : 1.0;
  const absl::Duration wait = current_ * factor;
  current_ = std::min(current_ * options_.multiplier, options_.max_backoff);
  return wait;
}

namespace {
constexpr absl::string_view kRetrySummaryStart = " (gave up after ";
}  // namespace

absl::string_view WithoutRetrySummary(absl::string_view message) {
  const size_t at = message.rfind(kRetrySummaryStart);
  if (at == absl::string_view::npos || !absl::EndsWith(message, ")")) return message;
  return message.substr(0, at);
}

absl::Status RetryCall(const RetryOptions& options, const std::function<absl::Status()>& attempt,
                       const std::function<void(absl::Duration)>& wait_for,
                       const RetryObserver& observe) {
  Backoff backoff(options);
  absl::Status status;
  const int attempts = std::max(1, options.max_attempts);
  const int deadline_attempts = std::max(1, options.max_deadline_attempts);
  int made = 0, timed_out = 0;
  bool past_window = false;
  // A clock that no time adjustment moves.
  const auto first = std::chrono::steady_clock::now();
  for (int i = 1; i <= attempts; ++i) {
    status = attempt();
    made = i;
    if (status.ok() || !IsRetryable(status)) return status;
    if (absl::IsDeadlineExceeded(status) && ++timed_out >= deadline_attempts) break;
    if (i == attempts) break;
    const absl::Duration wait = backoff.Next();
    if (absl::FromChrono(std::chrono::steady_clock::now() - first) + wait > options.retry_window) {
      past_window = true;
      break;
    }
    if (observe) observe(status, i + 1, attempts, wait);
    if (wait_for) {
      wait_for(wait);
    } else {
      absl::SleepFor(wait);
    }
    // A wait that overran (a late timer) must not start an attempt past the
    // window either.
    if (absl::FromChrono(std::chrono::steady_clock::now() - first) > options.retry_window) {
      past_window = true;
      break;
    }
  }
  std::string why;
  if (past_window) {
    why = absl::StrCat(
        "; another would start more than ",
        // Whole milliseconds: a window computed from a
        // deadline reads 1s, not 999.998557ms.
        absl::FormatDuration(absl::Ceil(options.retry_window, absl::Milliseconds(1))),
        " after the first", options.window_reason.empty() ? "" : ", ", options.window_reason);
  }
  return absl::Status(
      status.code(),
      absl::StrCat(status.message(), kRetrySummaryStart, made, " attempt", made == 1 ? "" : "s",
                   timed_out > 0 ? absl::StrCat(", ", timed_out, " of them timed out") : "", why,
                   ")"));
}

}  // namespace psflow
