// gRPC writes its own log lines (gpr_log, to stderr by default). When a
// server cannot bind its port, gRPC's HTTP/2 server logs a kilobyte of
// nested errors about it before BuildAndStart returns; psflow's shard then
// says why in one line of its own (ListenFailureReason). GrpcLogHold holds
// that log line back while the shard starts, so that it can be left out
// where the shard has explained the failure.
#ifndef PSFLOW_COMMON_GRPC_LOG_H_
#define PSFLOW_COMMON_GRPC_LOG_H_

namespace psflow {

// While it lives, the lines that gRPC's HTTP/2 server (chttp2_server.cc)
// logs on the thread that made the hold are held back; every other gRPC log
// line, of any thread, is written at once, in gRPC's own format. When it
// ends, gRPC's default log function is back, and the held lines are written
// with their own time, unless DropHeldLines() was called. One hold at a
// time in a process: a second waits for the first to end.
class GrpcLogHold {
 public:
  GrpcLogHold();
  ~GrpcLogHold();
  GrpcLogHold(const GrpcLogHold&) = delete;
  GrpcLogHold& operator=(const GrpcLogHold&) = delete;

  // The lines held so far, and any held later, are not written.
  void DropHeldLines();
  // How many lines are held now.
  int HeldLines() const;

 private:
  bool drop_ = false;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_GRPC_LOG_H_
