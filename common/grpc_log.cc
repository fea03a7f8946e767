#include "common/grpc_log.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/synchronization/mutex.h"
#include "grpc/support/log.h"

namespace psflow {
namespace {

struct HeldLine {
  const char* file;  // gRPC passes __FILE__: it outlives the hold
  int line;
  gpr_log_severity severity;
  std::string message;
  bool own;  // logged by the holding thread
};

// Taken for the whole of a hold.
ABSL_CONST_INIT absl::Mutex hold_mu(absl::kConstInit);
// Guards the held lines; taken by gRPC's logging threads too.
ABSL_CONST_INIT absl::Mutex lines_mu(absl::kConstInit);
std::vector<HeldLine>* held ABSL_GUARDED_BY(lines_mu) = nullptr;
std::thread::id holder ABSL_GUARDED_BY(lines_mu);

void HoldLine(gpr_log_func_args* args) {
  {
    absl::MutexLock lock(&lines_mu);
    if (held != nullptr) {
      held->push_back({args->file, args->line, args->severity, args->message,
                       std::this_thread::get_id() == holder});
      return;
    }
  }
  // The hold ended after this call loaded the function: gRPC's default is
  // back in place, and this goes to it.
  gpr_log_message(args->file, args->line, args->severity, args->message);
}

}  // namespace

GrpcLogHold::GrpcLogHold() {
  hold_mu.Lock();
  {
    absl::MutexLock lock(&lines_mu);
    held = new std::vector<HeldLine>();
    holder = std::this_thread::get_id();
  }
  gpr_set_log_function(HoldLine);
}

GrpcLogHold::~GrpcLogHold() {
  gpr_set_log_function(nullptr);  // gRPC's default again
  std::vector<HeldLine>* lines;
  {
    absl::MutexLock lock(&lines_mu);
    lines = held;
    held = nullptr;
  }
  for (const HeldLine& l : *lines) {
    if (l.own && drop_own_) continue;
    gpr_log_message(l.file, l.line, l.severity, l.message.c_str());
  }
  delete lines;
  hold_mu.Unlock();
}

void GrpcLogHold::DropOwnLines() { drop_own_ = true; }

int GrpcLogHold::OwnLines() const {
  absl::MutexLock lock(&lines_mu);
  int n = 0;
  for (const HeldLine& l : *held) n += l.own ? 1 : 0;
  return n;
}

}  // namespace psflow
