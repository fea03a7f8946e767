#include "common/grpc_log.h"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "grpc/support/log.h"

namespace psflow {
namespace {

struct HeldLine {
  const char* file;  // gRPC passes __FILE__: it outlives the hold
  int line;
  gpr_log_severity severity;
  std::string message;
  timespec time;
  long thread;
};

// Taken for the whole of a hold.
ABSL_CONST_INIT absl::Mutex hold_mu(absl::kConstInit);
// Guards the held lines.
ABSL_CONST_INIT absl::Mutex lines_mu(absl::kConstInit);
std::vector<HeldLine>* held ABSL_GUARDED_BY(lines_mu) = nullptr;
// Set on the thread that made the hold, while it lasts.
thread_local bool holding_here = false;

// One line as gRPC 1.51's default log function writes it (without the stack
// trace it may add to ERROR lines), in one write.
void WriteLikeGrpc(const char* file, int line, gpr_log_severity severity,
                   const std::string& message, const timespec& time, long thread) {
  const char* slash = std::strrchr(file, '/');
  char when[64] = "error:localtime";
  struct tm tm;
  if (localtime_r(&time.tv_sec, &tm) != nullptr) {
    std::strftime(when, sizeof(when), "%m%d %H:%M:%S", &tm);
  }
  const std::string prefix = absl::StrFormat(
      "%s%s.%09d %7d %s:%d]", gpr_log_severity_string(severity), when,
      static_cast<int>(time.tv_nsec), thread, slash != nullptr ? slash + 1 : file, line);
  const std::string text = absl::StrFormat("%-70s %s\n", prefix, message);
  std::fwrite(text.data(), 1, text.size(), stderr);
}

void HoldOrWrite(gpr_log_func_args* args) {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  const long thread = syscall(SYS_gettid);
  if (holding_here && absl::EndsWith(args->file, "chttp2_server.cc")) {
    absl::MutexLock lock(&lines_mu);
    if (held != nullptr) {
      held->push_back({args->file, args->line, args->severity, args->message, now, thread});
      return;
    }
  }
  // Not through gpr_log_message: while the hold lasts that would come back
  // here.
  WriteLikeGrpc(args->file, args->line, args->severity, args->message, now, thread);
}

}  // namespace

GrpcLogHold::GrpcLogHold() {
  hold_mu.Lock();
  {
    absl::MutexLock lock(&lines_mu);
    held = new std::vector<HeldLine>();
  }
  holding_here = true;
  gpr_set_log_function(HoldOrWrite);
}

GrpcLogHold::~GrpcLogHold() {
  gpr_set_log_function(nullptr);  // gRPC's default again
  holding_here = false;
  std::vector<HeldLine>* lines;
  {
    absl::MutexLock lock(&lines_mu);
    lines = held;
    held = nullptr;
  }
  if (!drop_) {
    for (const HeldLine& l : *lines) {
      WriteLikeGrpc(l.file, l.line, l.severity, l.message, l.time, l.thread);
    }
  }
  delete lines;
  hold_mu.Unlock();
}

void GrpcLogHold::DropHeldLines() { drop_ = true; }

int GrpcLogHold::HeldLines() const {
  absl::MutexLock lock(&lines_mu);
  return static_cast<int>(held->size());
}

}  // namespace psflow
