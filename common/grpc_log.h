// gRPC writes its own log lines (gpr_log, to stderr by default). When a
// server cannot bind its port, gRPC logs a kilobyte of nested errors about
// it before BuildAndStart returns; psflow's shard then says why in one line
// of its own (ListenFailureReason). GrpcLogHold holds gRPC's lines back
// while the shard starts, so that those the shard has explained can be left
// out and every other line is still logged.
#ifndef PSFLOW_COMMON_GRPC_LOG_H_
#define PSFLOW_COMMON_GRPC_LOG_H_

namespace psflow {

// While it lives, what gRPC logs is held back instead of written. When it
// ends it gives gRPC back its default log function and logs what it held,
// in order, with each line's own file and line number; except the lines
// this thread logged, once DropOwnLines() was called. Lines from other
// threads are always logged. One hold at a time in a process: a second
// waits for the first to end. Keep it short (a server's start): nothing
// gRPC logs in the meantime shows until it ends.
class GrpcLogHold {
 public:
  GrpcLogHold();
  ~GrpcLogHold();
  GrpcLogHold(const GrpcLogHold&) = delete;
  GrpcLogHold& operator=(const GrpcLogHold&) = delete;

  // The lines this thread has logged so far in this hold, and later ones,
  // are not logged when it ends.
  void DropOwnLines();
  // How many lines this thread has logged in this hold so far.
  int OwnLines() const;

 private:
  bool drop_own_ = false;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_GRPC_LOG_H_
