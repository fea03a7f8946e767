#include "ps_server/grpc_ps_server.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/process_stats.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "psflow.grpc.pb.h"

namespace psflow::server {
namespace {

constexpr int64_t kDefaultPullChunkBytes = 1 << 20;

absl::Status SegmentSize(const Segment& segment, int64_t* count) {
  if (segment.data().size() % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment of '", segment.variable(), "' has ", segment.data().size(),
        " bytes of data; expected a multiple of 4 (float32 values)"));
  }
  *count = static_cast<int64_t>(segment.data().size() / 4);
  return absl::OkStatus();
}

PartDefinition FromProto(const PartDef& def) {
  PartDefinition out;
  out.variable = def.variable();
  out.variable_shape.assign(def.variable_shape().begin(), def.variable_shape().end());
  out.row_begin = def.row_begin();
  out.row_end = def.row_end();
  return out;
}

void ToProto(const PartDefinition& def, PartDef* out) {
  out->set_variable(def.variable);
  for (int64_t d : def.variable_shape) out->add_variable_shape(d);
  out->set_row_begin(def.row_begin);
  out->set_row_end(def.row_end);
}

}  // namespace

// The ParameterServer service over a VariableStore. Handlers never throw or
// crash on a request: every problem becomes a status naming the variable.
class PsServer::Service final : public ParameterServer::Service {
 public:
  explicit Service(VariableStore* store) : store_(store) {}

  grpc::Status RegisterVariables(grpc::ServerContext* context,
                                 grpc::ServerReader<RegisterRequest>* reader,
                                 RegisterResponse* response) override {
    return ToGrpcStatus(DoRegister(context, reader, response));
  }

  grpc::Status Push(grpc::ServerContext* context, grpc::ServerReader<PushRequest>* reader,
                    PushResponse* response) override {
    return ToGrpcStatus(DoPush(context, reader, response));
  }

  grpc::Status Pull(grpc::ServerContext* context, const PullRequest* request,
                    grpc::ServerWriter<PullResponse>* writer) override {
    return ToGrpcStatus(DoPull(context, *request, writer));
  }

  grpc::Status GetStatus(grpc::ServerContext*, const StatusRequest*,
                         StatusResponse* response) override {
    const VariableStoreOptions& o = store_->options();
    response->set_shard_index(o.shard_index);
    response->set_num_shards(o.num_shards);
    response->set_optimizer(store_->optimizer().DebugString());
    response->set_plan_fingerprint(store_->plan_fingerprint());
    for (const PartSnapshot& part : store_->ListParts()) {
      PartStatus* p = response->add_parts();
      ToProto(part.def, p->mutable_def());
      p->set_num_elements(part.num_elements);
      p->set_version(part.version);
    }
    const StoreStats stats = store_->stats();
    response->set_pushes(stats.pushes);
    response->set_duplicate_elements(stats.duplicate_elements);
    response->set_rejected_requests(stats.rejected_requests);
    response->set_parameter_bytes(stats.parameter_bytes);
    response->set_bytes_received(bytes_received_);
    response->set_bytes_sent(bytes_sent_);
    response->set_resident_bytes(ResidentBytes());
    return grpc::Status::OK;
  }

 private:
  absl::Status DoRegister(grpc::ServerContext* context,
                          grpc::ServerReader<RegisterRequest>* reader,
                          RegisterResponse* response) {
    RegisterRequest msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      return absl::InvalidArgumentError(
          "RegisterVariables: the first message must carry the header");
    }
    const RegisterHeader& h = msg.header();
    std::vector<PartDefinition> parts;
    for (const PartDef& def : h.parts()) parts.push_back(FromProto(def));
    PSFLOW_ASSIGN_OR_RETURN(auto registration,
                            store_->BeginRegistration(h.plan_fingerprint(), h.num_shards(),
                                                      h.shard_index(), std::move(parts)));
    do {
      for (const Segment& segment : msg.segments()) {
        int64_t count = 0;
        PSFLOW_RETURN_IF_ERROR(SegmentSize(segment, &count));
        PSFLOW_RETURN_IF_ERROR(registration->AddValues(segment.variable(), segment.offset(),
                                                       segment.data().data(), count));
        bytes_received_ += static_cast<int64_t>(segment.data().size());
      }
    } while (reader->Read(&msg));
    if (context->IsCancelled()) {
      return absl::CancelledError("RegisterVariables: the client went away; nothing registered");
    }
    PSFLOW_ASSIGN_OR_RETURN(RegisterResult result, registration->Commit());
    response->set_parts_created(result.parts_created);
    response->set_parts_kept(result.parts_kept);
    return absl::OkStatus();
  }

  absl::Status DoPush(grpc::ServerContext* context, grpc::ServerReader<PushRequest>* reader,
                      PushResponse* response) {
    // One message object for the whole stream: its buffers are reused, so
    // the hot path allocates nothing once warm.
    PushRequest msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      return absl::InvalidArgumentError("Push: the first message must carry the header");
    }
    const PushHeader& h = msg.header();
    auto session = store_->BeginPush(
        {h.worker_id(), h.step(), h.read_version(), h.request_id()});
    absl::Status status = [&]() -> absl::Status {
      do {
        // Validate the whole message before applying any of it.
        for (const Segment& segment : msg.segments()) {
          int64_t count = 0;
          PSFLOW_RETURN_IF_ERROR(SegmentSize(segment, &count));
          PSFLOW_RETURN_IF_ERROR(session->Validate(segment.variable(), segment.offset(),
                                                   segment.data().data(), count));
        }
        for (const Segment& segment : msg.segments()) {
          PSFLOW_RETURN_IF_ERROR(session->Apply(segment.variable(), segment.offset(),
                                                segment.data().data(),
                                                static_cast<int64_t>(segment.data().size() / 4)));
          bytes_received_ += static_cast<int64_t>(segment.data().size());
        }
      } while (reader->Read(&msg));
      if (context->IsCancelled()) {
        return absl::CancelledError("Push: the stream broke before it was complete");
      }
      return absl::OkStatus();
    }();
    session->Finish(status);
    PSFLOW_RETURN_IF_ERROR(status);
    response->set_elements_applied(session->elements_applied());
    response->set_elements_skipped(session->elements_skipped());
    return absl::OkStatus();
  }

  absl::Status DoPull(grpc::ServerContext* context, const PullRequest& request,
                      grpc::ServerWriter<PullResponse>* writer) {
    std::vector<PartSnapshot> parts;
    if (request.variables().empty()) {
      parts = store_->ListParts();
    } else {
      for (const std::string& name : request.variables()) {
        PSFLOW_ASSIGN_OR_RETURN(PartSnapshot part, store_->GetPart(name));
        parts.push_back(std::move(part));
      }
    }
    int64_t chunk_bytes = request.max_chunk_bytes() > 0 ? request.max_chunk_bytes()
                                                        : kDefaultPullChunkBytes;
    chunk_bytes = std::max<int64_t>(4, std::min(chunk_bytes, store_->options().max_chunk_bytes));
    const int64_t chunk_elements = chunk_bytes / 4;

    PullResponse msg;
    int64_t in_msg = 0;  // elements in msg
    auto flush = [&]() -> absl::Status {
      if (msg.segments_size() == 0) return absl::OkStatus();
      if (!writer->Write(msg)) {
        return absl::CancelledError("Pull: the client went away");
      }
      bytes_sent_ += in_msg * 4;
      msg.Clear();  // keeps the allocated segments and their capacity
      in_msg = 0;
      return absl::OkStatus();
    };
    for (const PartSnapshot& part : parts) {
      for (int64_t offset = 0; offset < part.num_elements;) {
        const int64_t take = std::min(part.num_elements - offset, chunk_elements - in_msg);
        Segment* segment = msg.add_segments();
        segment->set_variable(part.def.variable);
        segment->set_offset(offset);
        std::string* data = segment->mutable_data();
        data->resize(take * 4);
        PSFLOW_ASSIGN_OR_RETURN(int64_t version,
                                store_->Read(part.def.variable, offset, take, data->data()));
        msg.add_versions(version);
        offset += take;
        in_msg += take;
        if (in_msg >= chunk_elements) PSFLOW_RETURN_IF_ERROR(flush());
      }
      if (context->IsCancelled()) return absl::CancelledError("Pull: cancelled");
    }
    return flush();
  }

  VariableStore* const store_;
  std::atomic<int64_t> bytes_received_{0};
  std::atomic<int64_t> bytes_sent_{0};
};

absl::StatusOr<std::unique_ptr<PsServer>> PsServer::Start(const PsServerOptions& options) {
  auto server = std::unique_ptr<PsServer>(new PsServer());
  server->options_ = options;
  PSFLOW_ASSIGN_OR_RETURN(server->store_, VariableStore::Create(options.store));
  server->service_ = std::make_unique<Service>(server->store_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(server->service_.get());
  // Room for one full chunk plus names and framing.
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(options.store.max_chunk_bytes + (1 << 20), INT32_MAX)));
  builder.SetMaxSendMessageSize(-1);
  if (options.threads > 0) {
    grpc::ResourceQuota quota("psflow_ps");
    quota.SetMaxThreads(std::max(options.threads, 2));
    builder.SetResourceQuota(quota);
  }
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("ps shard ", options.store.shard_index, " could not listen on ",
                     options.address, " (address in use, or not a valid host:port?)"));
  }
  const bool is_unix = absl::StartsWith(options.address, "unix:");
  if (!is_unix && port == 0) {
    return absl::UnavailableError(absl::StrCat("could not bind ", options.address));
  }
  server->port_ = is_unix ? 0 : port;
  if (auto* health = server->server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
  }
  return server;
}

PsServer::~PsServer() { Shutdown(absl::Seconds(1)); }

std::string PsServer::client_address() const {
  if (absl::StartsWith(options_.address, "unix:")) return options_.address;
  return absl::StrCat("localhost:", port_);
}

void PsServer::Shutdown(absl::Duration grace) {
  if (server_ == nullptr || shut_down_.exchange(true)) return;
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoSeconds(grace));
  server_->Wait();
}

void PsServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace psflow::server
