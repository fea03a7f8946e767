#include "common/retry.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

RetryOptions Fast() {
  RetryOptions o;
  o.initial_backoff = absl::Microseconds(10);
  o.max_backoff = absl::Microseconds(100);
  return o;
}

TEST(RetryCallTest, RefusedConnectionsAreRetriedUpToMaxAttempts) {
  int calls = 0;
  const absl::Status s = RetryCall(Fast(), [&] {
    ++calls;
    return absl::UnavailableError("connection refused");
  });
  EXPECT_EQ(calls, 10);
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_THAT(s.message(), HasSubstr("connection refused (gave up after 10 attempts)"));
}

// The waits between attempts go to the caller's `wait` where it gives one
// (the gRPC client watches its channels there), one per retry, each the
// backoff's.
TEST(RetryCallTest, WaitsThroughTheCallersWaitWhereGiven) {
  RetryOptions o;
  o.initial_backoff = absl::Milliseconds(100);
  o.max_backoff = absl::Milliseconds(400);
  o.jitter = 0;
  o.max_attempts = 5;
  std::vector<absl::Duration> waits;
  int calls = 0;
  const absl::Status s = RetryCall(
      o,
      [&] {
        ++calls;
        return absl::UnavailableError("connection refused");
      },
      [&](absl::Duration d) { waits.push_back(d); });
  EXPECT_EQ(calls, 5);
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_THAT(waits, ::testing::ElementsAre(absl::Milliseconds(100), absl::Milliseconds(200),
                                            absl::Milliseconds(400), absl::Milliseconds(400)));
}

// The observer hears of each retry, before its wait: the failure that
// caused it, the attempt to come and the wait. Nothing after the last
// attempt, and nothing for a call that needed no retry.
TEST(RetryCallTest, ObserverHearsOfEachRetryBeforeItsWait) {
  RetryOptions o;
  o.initial_backoff = absl::Milliseconds(100);
  o.max_backoff = absl::Milliseconds(200);
  o.jitter = 0;
  o.max_attempts = 4;
  std::vector<std::string> events;
  int calls = 0;
  const absl::Status s = RetryCall(
      o, [&] { return absl::UnavailableError(absl::StrCat("refused ", ++calls)); },
      [&](absl::Duration d) { events.push_back(absl::StrCat("wait ", absl::FormatDuration(d))); },
      [&](const absl::Status& failed, int next, int most, absl::Duration wait) {
        events.push_back(absl::StrCat(failed.message(), ", attempt ", next, " of ", most, " in ",
                                      absl::FormatDuration(wait)));
      });
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_THAT(events, ::testing::ElementsAre("refused 1, attempt 2 of 4 in 100ms", "wait 100ms",
                                             "refused 2, attempt 3 of 4 in 200ms", "wait 200ms",
                                             "refused 3, attempt 4 of 4 in 200ms", "wait 200ms"));

  events.clear();
  ASSERT_TRUE(RetryCall(
                  o, [] { return absl::OkStatus(); }, nullptr,
                  [&](const absl::Status&, int, int, absl::Duration) { events.push_back("retry"); })
                  .ok());
  EXPECT_THAT(events, ::testing::IsEmpty());
}

// A wait that returns late (a timer that fired late) starts no attempt past
// the retry window: the window is checked before each wait and after it.
TEST(RetryCallTest, AWaitThatOverranTheWindowStartsNoAttempt) {
  RetryOptions o;
  o.initial_backoff = absl::Milliseconds(10);
  o.jitter = 0;
  o.retry_window = absl::Milliseconds(50);
  int calls = 0;
  const absl::Status s = RetryCall(
      o,
      [&] {
        ++calls;
        return absl::UnavailableError("connection refused");
      },
      [](absl::Duration) { absl::SleepFor(absl::Milliseconds(100)); });
  EXPECT_EQ(calls, 1);
  EXPECT_THAT(s.message(), HasSubstr("another would start more than 50ms after the first"));
}

// A hung peer makes every attempt wait its whole deadline: ten of them took
// ten deadlines to report it.
TEST(RetryCallTest, TimeoutsAreRetriedOnlyUpToMaxDeadlineAttempts) {
  int calls = 0;
  absl::Status s = RetryCall(Fast(), [&] {
    ++calls;
    return absl::DeadlineExceededError("deadline");
  });
  EXPECT_EQ(calls, 2);
  EXPECT_TRUE(absl::IsDeadlineExceeded(s));
  EXPECT_THAT(s.message(), HasSubstr("(gave up after 2 attempts, 2 of them timed out)"));

  // Refusals do not use up the timeout allowance, nor the reverse.
  calls = 0;
  s = RetryCall(Fast(), [&] {
    ++calls;
    return calls % 3 == 0 ? absl::DeadlineExceededError("deadline")
                          : absl::UnavailableError("refused");
  });
  EXPECT_EQ(calls, 6);  // timeouts at calls 3 and 6
  EXPECT_THAT(s.message(), HasSubstr("gave up after 6 attempts, 2 of them timed out"));
}

// A push may be retried only while the shard still remembers its request
// id: no attempt starts past the window, and the error says why.
TEST(RetryCallTest, NoRetryStartsPastTheRetryWindow) {
  RetryOptions o = Fast();
  o.retry_window = absl::ZeroDuration();
  o.window_reason = "when the shard may have forgotten the id";
  int calls = 0;
  absl::Status s = RetryCall(o, [&] {
    ++calls;
    return absl::UnavailableError("refused");
  });
  EXPECT_EQ(calls, 1);  // the first attempt always runs
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_THAT(s.message(), HasSubstr("refused (gave up after 1 attempt; another would start more "
                                     "than 0 after the first, when the shard may have forgotten "
                                     "the id)"));

  // Attempts that each take 20 ms, in a 50 ms window: the third begins about
  // 40 ms after the first (and the backoff is microseconds); no fourth.
  o.retry_window = absl::Milliseconds(50);
  calls = 0;
  s = RetryCall(o, [&] {
    ++calls;
    absl::SleepFor(absl::Milliseconds(20));
    return absl::UnavailableError("refused");
  });
  EXPECT_LE(calls, 3);
  EXPECT_THAT(s.message(), HasSubstr("after the first"));

  // Within a window that none of them reaches, every attempt runs: the
  // window stops retries, not the ones it leaves room for.
  o.retry_window = absl::Seconds(30);
  calls = 0;
  s = RetryCall(o, [&] {
    ++calls;
    return absl::UnavailableError("refused");
  });
  EXPECT_EQ(calls, o.max_attempts);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("gave up after ", o.max_attempts, " attempts")));
}

// A caller that goes on waiting shows the last attempt's error without the
// account of the attempts ("gave up" would say the opposite), whatever
// that account holds; a message without one is left whole.
TEST(RetryCallTest, SummaryComesOffTheFinalErrorAndNothingElse) {
  RetryOptions o = Fast();
  o.max_attempts = 2;
  const absl::Status s = RetryCall(
      o, [] { return absl::UnavailableError("ps shard 0 (h:1): Connection refused (errno 111)"); });
  ASSERT_THAT(s.message(), HasSubstr("gave up after 2 attempts"));
  EXPECT_EQ(WithoutRetrySummary(s.message()), "ps shard 0 (h:1): Connection refused (errno 111)");
  o.retry_window = absl::ZeroDuration();
  o.window_reason = "past this status check's deadline";
  const absl::Status windowed = RetryCall(o, [] { return absl::UnavailableError("refused"); });
  ASSERT_THAT(windowed.message(), HasSubstr("past this status check's deadline)"));
  EXPECT_EQ(WithoutRetrySummary(windowed.message()), "refused");
  for (const char* whole :
       {"refused", "refused (errno 111)", "x (gave up after 3 attempts) and on", ""}) {
    EXPECT_EQ(WithoutRetrySummary(whole), whole);
  }
}

TEST(RetryCallTest, SuccessAndPermanentErrorsEndAtOnce) {
  int calls = 0;
  EXPECT_TRUE(RetryCall(Fast(), [&] {
                return ++calls < 3 ? absl::UnavailableError("x") : absl::OkStatus();
              }).ok());
  EXPECT_EQ(calls, 3);
  calls = 0;
  const absl::Status s = RetryCall(Fast(), [&] {
    ++calls;
    return absl::InvalidArgumentError("bad shape");
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.message(), "bad shape");
}

TEST(BackoffTest, GrowsWithinJitterUpToTheCap) {
  RetryOptions o;
  o.initial_backoff = absl::Milliseconds(100);
  o.max_backoff = absl::Milliseconds(400);
  o.multiplier = 2.0;
  o.jitter = 0.2;
  Backoff b(o);
  const double want[] = {100, 200, 400, 400, 400};
  for (double w : want) {
    const double got = absl::ToDoubleMilliseconds(b.Next());
    EXPECT_GE(got, 0.8 * w - 1e-9);
    EXPECT_LE(got, 1.2 * w + 1e-9);
  }
}

TEST(CheckRetryOptionsTest, RefusesWaitsThatMeanNothing) {
  EXPECT_TRUE(CheckRetryOptions(RetryOptions()).ok());
  RetryOptions zero;  // no waits at all is a choice
  zero.initial_backoff = zero.max_backoff = absl::ZeroDuration();
  zero.jitter = 0;
  zero.multiplier = 1;
  EXPECT_TRUE(CheckRetryOptions(zero).ok());
  const struct {
    void (*change)(RetryOptions*);
    const char* says;
  } bad[] = {
      {[](RetryOptions* o) { o->jitter = 1.0; }, "jitter is 1; expected at least 0 and below 1"},
      {[](RetryOptions* o) { o->jitter = -0.1; }, "jitter is -0.1"},
      {[](RetryOptions* o) { o->jitter = std::nan(""); }, "jitter is nan"},
      {[](RetryOptions* o) { o->multiplier = 0.5; }, "multiplier is 0.5; expected 1 to 1e9"},
      {[](RetryOptions* o) { o->initial_backoff = absl::Seconds(10); },
       "initial_backoff is 10s; expected 0 to max_backoff (5s)"},
      {[](RetryOptions* o) { o->initial_backoff = absl::Seconds(-1); }, "initial_backoff is -1s"},
      {[](RetryOptions* o) { o->max_backoff = absl::InfiniteDuration(); }, "max_backoff is inf"},
  };
  for (const auto& [change, says] : bad) {
    RetryOptions options;
    change(&options);
    const absl::Status refused = CheckRetryOptions(options);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << says;
    EXPECT_THAT(refused.message(), HasSubstr(says));
  }
}

}  // namespace
}  // namespace psflow
