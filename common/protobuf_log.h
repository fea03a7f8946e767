// Protobuf writes its own log lines (to stderr by default). Parsing a string
// field that holds invalid UTF-8 logs an ERROR line, so a client sending
// such names could write a line per request into a shard's log.
// LimitProtobufLog keeps those lines, but at most so many a minute, and says
// how many it dropped with the next line it writes.
#ifndef PSFLOW_COMMON_PROTOBUF_LOG_H_
#define PSFLOW_COMMON_PROTOBUF_LOG_H_

#include <cstdint>

#include "absl/time/time.h"

namespace psflow {

// Routes protobuf's log lines to stderr, at most `lines_per_minute` a minute
// (fatal ones always). Process-wide: call once at the start of main.
void LimitProtobufLog(int lines_per_minute);

// The limit on its own: at most `lines` lines in each `window`, counted from
// the first line of the window.
class LogRateLimiter {
 public:
  LogRateLimiter(int lines, absl::Duration window) : lines_(lines), window_(window) {}
  // Whether a line at `now` may be written. When it may, `*dropped` gets the
  // number of lines refused since the last one written.
  bool Admit(absl::Time now, int64_t* dropped);

 private:
  const int lines_;
  const absl::Duration window_;
  absl::Time window_start_ = absl::InfinitePast();
  int written_ = 0;
  int64_t dropped_ = 0;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_PROTOBUF_LOG_H_
