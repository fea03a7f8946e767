// Serves a stand-in gRPC service on an ephemeral loopback port, for tests
// of the client against a shard that behaves in one chosen way.
#ifndef PSFLOW_TESTS_CLUSTER_LOOPBACK_SERVER_H_
#define PSFLOW_TESTS_CLUSTER_LOOPBACK_SERVER_H_

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace psflow::test_support {

// Starts a server for `service` on 127.0.0.1 with a free port and sets
// `*address` to "127.0.0.1:port"; null if it could not listen.
inline std::unique_ptr<grpc::Server> ServeOnLoopback(grpc::Service* service, std::string* address) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

}  // namespace psflow::test_support

#endif  // PSFLOW_TESTS_CLUSTER_LOOPBACK_SERVER_H_
