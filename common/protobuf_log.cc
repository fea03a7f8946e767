#include "common/protobuf_log.h"

#include <cstdio>
#include <string>

#include "absl/base/const_init.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/stubs/logging.h"

namespace psflow {

bool LogRateLimiter::Admit(absl::Time now, int64_t* dropped) {
  if (now - window_start_ >= window_) {
    window_start_ = now;
    written_ = 0;
  }
  if (written_ >= lines_) {
    ++dropped_;
    return false;
  }
  ++written_;
  *dropped = dropped_;
  dropped_ = 0;
  return true;
}

namespace {

ABSL_CONST_INIT absl::Mutex log_mu(absl::kConstInit);
LogRateLimiter* limiter ABSL_GUARDED_BY(log_mu) = nullptr;

const char* LevelName(google::protobuf::LogLevel level) {
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO:
      return "INFO";
    case google::protobuf::LOGLEVEL_WARNING:
      return "WARNING";
    case google::protobuf::LOGLEVEL_ERROR:
      return "ERROR";
    case google::protobuf::LOGLEVEL_FATAL:
      return "FATAL";
  }
  return "?";
}

void LimitedHandler(google::protobuf::LogLevel level, const char* filename, int line,
                    const std::string& message) {
  int64_t dropped = 0;
  if (level != google::protobuf::LOGLEVEL_FATAL) {
    absl::MutexLock lock(&log_mu);
    if (!limiter->Admit(absl::Now(), &dropped)) return;
  }
  std::string text = std::string("[libprotobuf ") + LevelName(level) + " " + filename + ":" +
                     std::to_string(line) + "] " + message;
  if (dropped > 0) {
    text += " (" + std::to_string(dropped) + " earlier protobuf log lines dropped: at most " +
            "so many a minute)";
  }
  text += "\n";
  std::fputs(text.c_str(), stderr);
}

}  // namespace

void LimitProtobufLog(int lines_per_minute) {
  {
    absl::MutexLock lock(&log_mu);
    delete limiter;
    limiter = new LogRateLimiter(lines_per_minute, absl::Minutes(1));
  }
  google::protobuf::SetLogHandler(&LimitedHandler);
}

}  // namespace psflow
