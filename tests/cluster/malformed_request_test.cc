// Mutated bytes on every method of a shard. Random valid requests of each
// method (RegisterVariables, Pull, Push, PushPull, GetStatus) are
// serialized, and their bytes are then flipped, overwritten, inserted,
// erased, truncated or repeated before they go out through gRPC as they
// are. Two shards start alike: the one under test gets the mutated bytes;
// a reference gets what protobuf's own parser reads in them, serialized
// again (and, from the first message protobuf refuses, one message that is
// surely bad). After every call:
//   * the shard under test has answered with a status (no crash, no hang)
//     and still serves;
//   * where protobuf read every message, both shards gave the same status
//     code and the same answer bytes; where it refused one, the shard
//     under test refused the call;
//   * both shards hold the same parts, values and versions. So bytes that
//     do not parse change nothing beyond the messages before them, and
//     bytes that do are applied as the shard applies the request protobuf
//     reads in them. Both shards run the same code, so this checks the
//     reading of hostile bytes, not whether a request is applied rightly:
//     push_model_test and ps_cluster_test check that;
//   * one call in six goes out unmutated, a valid request (a registration
//     of a fresh variable, a push, a pull), and must succeed.
// In CI's AddressSanitizer+UBSan pass this also runs every decoding path of
// the server on hostile input.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "gtest/gtest.h"
#include "ps_server/grpc_ps_server.h"
#include "psflow.grpc.pb.h"
#include "tests/common/proto_bytes_variant.h"
#include "worker/grpc_ps_client.h"

namespace psflow {
namespace {

using server::PsServer;
using server::PsServerOptions;

enum class Method { kRegister, kPull, kPush, kPushPull, kGetStatus };

const char* MethodName(Method m) {
  switch (m) {
    case Method::kRegister:
      return "/psflow.ParameterServer/RegisterVariables";
    case Method::kPull:
      return "/psflow.ParameterServer/Pull";
    case Method::kPush:
      return "/psflow.ParameterServer/Push";
    case Method::kPushPull:
      return "/psflow.ParameterServer/PushPull";
    case Method::kGetStatus:
      return "/psflow.ParameterServer/GetStatus";
  }
  return "";
}

const std::vector<VariableSpec>& Vars() {
  static const auto* vars =
      new std::vector<VariableSpec>{{"a", {64}}, {"b", {5}}, {"c", {3, 7}}};
  return *vars;
}

std::string Join(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

// What one call returned: its status and its answer messages, as bytes.
struct CallResult {
  grpc::Status status;
  std::vector<std::string> answers;
};

// Sends `messages` as they are to `method` (a unary or server-streaming
// method gets exactly one) and collects the answers.
CallResult Call(grpc::Channel* channel, Method method, const std::vector<std::string>& messages) {
  using grpc::ByteBuffer;
  using grpc::internal::RpcMethod;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  CallResult result;
  switch (method) {
    case Method::kRegister:
    case Method::kPush: {
      const RpcMethod rpc(MethodName(method), RpcMethod::CLIENT_STREAMING);
      ByteBuffer answer;
      std::unique_ptr<grpc::ClientWriter<ByteBuffer>> writer(
          grpc::internal::ClientWriterFactory<ByteBuffer>::Create(channel, rpc, &context,
                                                                  &answer));
      for (const std::string& m : messages) {
        if (!writer->Write(ToBuffer(m))) break;
      }
      writer->WritesDone();
      result.status = writer->Finish();
      if (result.status.ok()) result.answers.push_back(Join(answer));
      break;
    }
    case Method::kPull: {
      const RpcMethod rpc(MethodName(method), RpcMethod::SERVER_STREAMING);
      std::unique_ptr<grpc::ClientReader<ByteBuffer>> reader(
          grpc::internal::ClientReaderFactory<ByteBuffer>::Create(channel, rpc, &context,
                                                                  ToBuffer(messages.at(0))));
      ByteBuffer answer;
      while (reader->Read(&answer)) result.answers.push_back(Join(answer));
      result.status = reader->Finish();
      break;
    }
    case Method::kPushPull: {
      const RpcMethod rpc(MethodName(method), RpcMethod::BIDI_STREAMING);
      std::unique_ptr<grpc::ClientReaderWriter<ByteBuffer, ByteBuffer>> stream(
          grpc::internal::ClientReaderWriterFactory<ByteBuffer, ByteBuffer>::Create(channel, rpc,
                                                                                    &context));
      for (const std::string& m : messages) {
        if (!stream->Write(ToBuffer(m))) break;
      }
      stream->WritesDone();
      ByteBuffer answer;
      while (stream->Read(&answer)) result.answers.push_back(Join(answer));
      result.status = stream->Finish();
      break;
    }
    case Method::kGetStatus: {
      const RpcMethod rpc(MethodName(method), RpcMethod::NORMAL_RPC);
      ByteBuffer answer;
      result.status = grpc::internal::BlockingUnaryCall<ByteBuffer, ByteBuffer>(
          channel, rpc, &context, ToBuffer(messages.at(0)), &answer);
      if (result.status.ok()) result.answers.push_back(Join(answer));
      break;
    }
  }
  return result;
}

// One to three random edits of `bytes`.
std::string Mutate(std::string bytes, std::mt19937_64& rng) {
  auto below = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const char kSpecial[] = {'\x00', '\x01', '\x7f', '\x80', '\xff', '\x0a', '\x12', '\x1a'};
  for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0; --edits) {
    switch (rng() % 6) {
      case 0:  // flip a bit
        if (!bytes.empty()) bytes[below(bytes.size())] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:  // overwrite a byte, often with a value that means something to protobuf
        if (!bytes.empty()) {
          bytes[below(bytes.size())] =
              rng() % 2 ? kSpecial[rng() % sizeof(kSpecial)] : static_cast<char>(rng());
        }
        break;
      case 2: {  // insert 1 to 8 bytes
        std::string extra(1 + rng() % 8, '\0');
        for (char& c : extra) c = static_cast<char>(rng());
        bytes.insert(below(bytes.size() + 1), extra);
        break;
      }
      case 3:  // erase 1 to 8 bytes
        if (!bytes.empty()) bytes.erase(below(bytes.size()), 1 + rng() % 8);
        break;
      case 4:  // truncate
        bytes.resize(below(bytes.size() + 1));
        break;
      case 5: {  // repeat a run of bytes somewhere
        if (bytes.empty()) break;
        const size_t begin = below(bytes.size());
        const std::string run = bytes.substr(begin, 1 + rng() % 16);
        bytes.insert(below(bytes.size() + 1), run);
        break;
      }
    }
  }
  return bytes;
}

class MalformedRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // protobuf logs an error for each string field that is not UTF-8; here
    // they are thousands, and expected.
    google::protobuf::SetLogHandler(nullptr);
    for (int i = 0; i < 2; ++i) {
      PsServerOptions options;
      options.address = "127.0.0.1:0";
      options.store.optimizer.kind = server::OptimizerOptions::Kind::kSgd;
      options.store.optimizer.learning_rate = 1.0f;
      options.store.max_chunk_bytes = 4096;
      // Small, so that mutated shapes reach the limit without touching much
      // memory.
      options.store.max_variable_bytes = 16 << 20;
      options.apply_threads = 0;  // in order, so that both shards end up alike
      auto server = PsServer::Start(options);
      ASSERT_TRUE(server.ok()) << server.status();
      servers_[i] = std::move(*server);
      channels_[i] = grpc::CreateChannel(servers_[i]->client_address(),
                                         grpc::InsecureChannelCredentials());
      stubs_[i] = ParameterServer::NewStub(channels_[i]);
      worker::GrpcPsClientOptions client_options;
      client_options.ps_addresses = {servers_[i]->client_address()};
      auto client = worker::CreateGrpcPsClient(Vars(), client_options);
      ASSERT_TRUE(client.ok()) << client.status();
      std::vector<std::vector<float>> initial;
      std::vector<const float*> ptrs;
      for (const auto& v : Vars()) {
        initial.emplace_back(v.num_elements());
        for (size_t e = 0; e < initial.back().size(); ++e) initial.back()[e] = float(e % 7);
      }
      for (const auto& values : initial) ptrs.push_back(values.data());
      ASSERT_TRUE((*client)->Register(ptrs).ok());
    }
    model_ = Status(0);
  }

  StatusResponse Status(int i) {
    grpc::ClientContext context;
    StatusResponse response;
    const grpc::Status status = stubs_[i]->GetStatus(&context, StatusRequest(), &response);
    EXPECT_TRUE(status.ok()) << "shard " << i << " stopped serving: " << status.error_message();
    return response;
  }

  // Every part's definition, version and values.
  std::map<std::string, std::string> State(int i) {
    std::map<std::string, std::string> state;
    const StatusResponse status = Status(i);
    for (const PartStatus& part : status.parts()) {
      state[part.def().variable()] = part.SerializeAsString();
    }
    grpc::ClientContext context;
    PullRequest request;
    request.set_max_chunk_bytes(1 << 20);
    auto reader = stubs_[i]->Pull(&context, request);
    PullResponse answer;
    while (reader->Read(&answer)) {
      for (const Segment& s : answer.segments()) {
        state[s.variable()] += absl::StrCat("|", s.offset(), ":", s.data());
      }
    }
    const grpc::Status finished = reader->Finish();
    EXPECT_TRUE(finished.ok()) << finished.error_message();
    return state;
  }

  // A random segment of a registered variable with small whole gradients.
  static void AddSegment(std::mt19937_64& rng, google::protobuf::RepeatedPtrField<Segment>* out) {
    const auto& var = Vars()[rng() % Vars().size()];
    const int64_t n = var.num_elements();
    Segment* s = out->Add();
    s->set_variable(var.name);
    s->set_offset(static_cast<int64_t>(rng() % n));
    const int64_t count = static_cast<int64_t>(rng() % (std::min<int64_t>(n - s->offset(), 8) + 1));
    std::vector<float> values(count);
    for (float& v : values) v = static_cast<float>(static_cast<int>(rng() % 7) - 3);
    s->set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  }

  // A valid request of `method`, as serialized messages.
  // `fresh_name`: the variable a registration of a new variable names.
  std::vector<std::string> ValidRequest(Method method, std::mt19937_64& rng,
                                        const std::string& fresh_name) {
    std::vector<std::string> out;
    switch (method) {
      case Method::kPush:
      case Method::kPushPull:
        for (int m = 0, n = 1 + static_cast<int>(rng() % 3); m < n; ++m) {
          PushRequest msg;
          if (m == 0) {
            msg.mutable_header()->set_worker_id(static_cast<int32_t>(rng() % 4));
            msg.mutable_header()->set_step(static_cast<int64_t>(rng() % 100));
            // A few ids, so that retries of one id are mutated too.
            msg.mutable_header()->set_request_id(rng() % 4 == 0 ? 0 : 1 + rng() % 16);
          }
          for (int s = 0, k = static_cast<int>(rng() % 4); s < k; ++s) {
            AddSegment(rng, msg.mutable_segments());
          }
          out.push_back(msg.SerializeAsString());
        }
        break;
      case Method::kPull: {
        PullRequest msg;
        msg.set_worker_id(1);
        msg.set_max_chunk_bytes(static_cast<int64_t>(rng() % 3) * 16);
        if (rng() % 2) {
          for (int i = 0, n = static_cast<int>(rng() % 3); i < n; ++i) {
            msg.add_variables(Vars()[rng() % Vars().size()].name);
          }
        } else {
          for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n; ++i) {
            const auto& var = Vars()[rng() % Vars().size()];
            PullRange* r = msg.add_ranges();
            r->set_variable(var.name);
            r->set_offset(static_cast<int64_t>(rng() % var.num_elements()));
            r->set_count(static_cast<int64_t>(rng() % (var.num_elements() - r->offset() + 1)));
          }
        }
        out.push_back(msg.SerializeAsString());
        break;
      }
      case Method::kRegister: {
        // Either the registered model again (kept), or a new variable of a
        // few rows: mutations then reach shapes, row ranges and values.
        // The model's own plan: mutated registrations may have added parts
        // under other fingerprints since.
        RegisterRequest msg;
        RegisterHeader* h = msg.mutable_header();
        h->set_plan_fingerprint(model_.plan_fingerprint());
        h->set_num_shards(1);
        h->set_shard_index(0);
        if (rng() % 2) {
          for (const PartStatus& part : model_.parts()) *h->add_parts() = part.def();
        } else {
          PartDef* def = h->add_parts();
          const std::string& name = fresh_name;
          def->set_variable(name);
          const int64_t rows = 1 + static_cast<int64_t>(rng() % 4), cols = 3;
          def->add_variable_shape(rows);
          def->add_variable_shape(cols);
          def->set_row_begin(0);
          def->set_row_end(rows);
          std::vector<float> values(rows * cols, 0.5f);
          // In one or two messages.
          const int64_t split = static_cast<int64_t>(rng() % (values.size() + 1));
          Segment* s = msg.add_segments();
          s->set_variable(name);
          s->set_data(std::string(reinterpret_cast<const char*>(values.data()), split * 4));
          out.push_back(msg.SerializeAsString());
          msg.Clear();  // frees `h` and `def`
          s = msg.add_segments();
          s->set_variable(name);
          s->set_offset(split);
          s->set_data(std::string(reinterpret_cast<const char*>(values.data() + split),
                                  (values.size() - split) * 4));
        }
        out.push_back(msg.SerializeAsString());
        break;
      }
      case Method::kGetStatus:
        out.push_back(StatusRequest().SerializeAsString());
        break;
    }
    return out;
  }

  // What protobuf reads in `bytes` as a request message of `method`, again
  // serialized; false where it refuses them.
  static bool Reparse(Method method, const std::string& bytes, std::string* out) {
    std::unique_ptr<google::protobuf::MessageLite> msg;
    switch (method) {
      case Method::kRegister:
        msg = std::make_unique<RegisterRequest>();
        break;
      case Method::kPull:
        msg = std::make_unique<PullRequest>();
        break;
      case Method::kPush:
      case Method::kPushPull:
        msg = std::make_unique<PushRequest>();
        break;
      case Method::kGetStatus:
        msg = std::make_unique<StatusRequest>();
        break;
    }
    if (!msg->ParseFromString(bytes)) return false;
    *out = msg->SerializeAsString();
    return true;
  }

  // Whether push message `bytes` parses once segment names are read as
  // bytes: then what protobuf refuses in it is a name that is not UTF-8.
  static bool OnlyNamesAreNotUtf8(const std::string& bytes) {
    auto variant = test_support::NewBytesVariant("psflow.PushRequest");
    return variant != nullptr && variant->ParseFromString(bytes);
  }

  // A message every shard refuses: a segment of a variable no registration
  // header names (RegisterVariables), or one of a partial float (Push).
  static std::string SurelyBad(Method method) {
    Segment s;
    s.set_variable("a");
    s.set_data("\x01");
    if (method == Method::kRegister) {
      RegisterRequest msg;
      *msg.add_segments() = s;
      msg.mutable_segments(0)->set_variable("");
      return msg.SerializeAsString();
    }
    PushRequest msg;
    *msg.add_segments() = s;
    return msg.SerializeAsString();
  }

  void RunCalls(uint64_t seed, int calls) {
    std::mt19937_64 rng(seed);
    int parsed_calls = 0, refused_by_protobuf = 0, accepted = 0;
    std::map<std::pair<int, int>, int> codes;  // (method, status code) -> calls
    int controls[5] = {};                       // unmutated calls (all OK) per method
    for (int call = 0; call < calls; ++call) {
      const Method method = static_cast<Method>(rng() % 5);
      const bool control = rng() % 6 == 0;
      // A registration of a new variable names one of its own (mutated ones
      // meet the variables registered before in the model's registrations).
      std::vector<std::string> sent =
          ValidRequest(method, rng, absl::StrCat(control ? "ctl" : "new", seed, "_", call));
      std::vector<std::string> reference;
      if (!control) {  // mutate some messages, at least one
        const size_t forced = rng() % sent.size();
        for (size_t m = 0; m < sent.size(); ++m) {
          if (m == forced || rng() % 3 == 0) sent[m] = Mutate(sent[m], rng);
        }
      }
      bool all_parsed = true;
      for (const std::string& m : sent) {
        std::string again;
        if (!Reparse(method, m, &again)) {
          all_parsed = false;
          break;
        }
        reference.push_back(again);
      }
      SCOPED_TRACE(absl::StrCat("seed ", seed, ", call ", call, ": ", MethodName(method),
                                control ? " (unmutated)" : "",
                                all_parsed ? "" : " (protobuf refuses a message)"));
      const CallResult got = Call(channels_[0].get(), method, sent);
      ++codes[{static_cast<int>(method), got.status.error_code()}];
      if (control) {
        ASSERT_TRUE(got.status.ok()) << "a valid request failed: " << got.status.error_message();
        ++controls[static_cast<int>(method)];
      }
      ASSERT_NE(got.status.error_code(), grpc::DEADLINE_EXCEEDED) << "the shard hung";
      ASSERT_NE(got.status.error_code(), grpc::UNAVAILABLE)
          << "the shard went away: " << got.status.error_message();
      if (all_parsed) {
        ++parsed_calls;
        const CallResult want = Call(channels_[1].get(), method, reference);
        ASSERT_EQ(got.status.error_code(), want.status.error_code())
            << "under test: " << got.status.error_message()
            << "\nreference: " << want.status.error_message();
        if (method != Method::kGetStatus) {  // its counters differ by the bytes received
          ASSERT_EQ(got.answers, want.answers);
        }
        if (got.status.ok()) ++accepted;
      } else {
        ++refused_by_protobuf;
        ASSERT_FALSE(got.status.ok()) << "a message protobuf refuses was accepted";
        if (method == Method::kPull || method == Method::kGetStatus) {
          ASSERT_EQ(got.status.error_code(), grpc::INVALID_ARGUMENT) << got.status.error_message();
        } else {
          // The messages before the refused one, then one that is refused
          // for sure: the shard under test must have done just that, and
          // refused the call as the reference did (INVALID_ARGUMENT for a
          // message that does not parse, or the error of one before it).
          // One exception: the shard reads a push's variable names as bytes
          // (docs/PROTOCOL.md), so a name that is not UTF-8, which protobuf
          // refuses, is NOT_FOUND there; only where that is all protobuf
          // objects to (the bytes parse when names are read as bytes).
          reference.push_back(SurelyBad(method));
          const CallResult want = Call(channels_[1].get(), method, reference);
          if (got.status.error_code() != want.status.error_code()) {
            // reference.size() - 1: the index of the message protobuf refused.
            ASSERT_TRUE(method != Method::kRegister &&
                        OnlyNamesAreNotUtf8(sent[reference.size() - 1]) &&
                        got.status.error_code() == grpc::NOT_FOUND &&
                        want.status.error_code() == grpc::INVALID_ARGUMENT)
                << "under test: " << got.status.error_code() << " " << got.status.error_message()
                << "\nreference: " << want.status.error_code() << " "
                << want.status.error_message();
          }
        }
      }
      ASSERT_EQ(State(0), State(1));
    }
    // The mix must exercise both kinds of outcome, and every method must
    // have run its controls and accepted some mutated requests too.
    EXPECT_GT(parsed_calls, calls / 10);
    EXPECT_GT(refused_by_protobuf, calls / 10);
    for (int m = 0; m < 5; ++m) {
      EXPECT_GT(controls[m], calls / 100) << MethodName(static_cast<Method>(m));
      EXPECT_GT((codes[{m, grpc::OK}] - controls[m]), 0)
          << MethodName(static_cast<Method>(m)) << ": no mutated request was accepted";
    }
    std::printf("seed %llu: %d calls, %d parsed by protobuf (%d accepted), %d refused by it\n",
                static_cast<unsigned long long>(seed), calls, parsed_calls, accepted,
                refused_by_protobuf);
    for (const auto& [key, n] : codes) {
      std::printf("  %s: code %d x %d\n", MethodName(static_cast<Method>(key.first)), key.second,
                  n);
    }
  }

  StatusResponse model_;  // the registered model's plan and parts, as at the start
  std::unique_ptr<PsServer> servers_[2];
  std::shared_ptr<grpc::Channel> channels_[2];
  std::unique_ptr<ParameterServer::Stub> stubs_[2];
};

TEST_F(MalformedRequestTest, MutatedBytesChangeOnlyWhatTheyParseAs) {
  // PSFLOW_MALFORMED_SEEDS=N runs N more seeds (for a longer search).
  const char* more = std::getenv("PSFLOW_MALFORMED_SEEDS");
  const int seeds = 1 + (more != nullptr ? std::atoi(more) : 0);
  for (int seed = 1; seed <= seeds && !HasFatalFailure(); ++seed) RunCalls(seed, 1500);
}

// A registration whose (valid) header asks for more than the shard may hold
// is refused whole, and the shard goes on serving.
TEST_F(MalformedRequestTest, HugeShapeInARegistrationIsRefused) {
  RegisterRequest msg;
  RegisterHeader* h = msg.mutable_header();
  h->set_plan_fingerprint(Status(0).plan_fingerprint());
  h->set_num_shards(1);
  PartDef* def = h->add_parts();
  def->set_variable("huge");
  def->add_variable_shape(int64_t{1} << 40);
  def->set_row_end(int64_t{1} << 40);
  const CallResult got = Call(channels_[0].get(), Method::kRegister, {msg.SerializeAsString()});
  EXPECT_EQ(got.status.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_THAT(got.status.error_message(), ::testing::HasSubstr("huge [1099511627776]"));
  EXPECT_EQ(State(0), State(1));
}

// A registration header's parts are checked as they are read: one of many
// empty parts (2 bytes each on the wire, about 80 in memory) is refused at
// the first, naming it, before the rest of the header is read.
TEST_F(MalformedRequestTest, HeaderOfEmptyPartsIsRefusedAtTheFirst) {
  RegisterRequest first, second;
  for (RegisterRequest* msg : {&first, &second}) {
    RegisterHeader* h = msg->mutable_header();
    h->set_plan_fingerprint(Status(0).plan_fingerprint());
    h->set_num_shards(1);
  }
  PartDef* good = first.mutable_header()->add_parts();
  good->set_variable("fresh");
  good->add_variable_shape(2);
  good->set_row_end(2);
  for (int i = 0; i < 100000; ++i) second.mutable_header()->add_parts();
  const CallResult got = Call(channels_[0].get(), Method::kRegister,
                              {first.SerializeAsString(), second.SerializeAsString()});
  EXPECT_EQ(got.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(
      got.status.error_message(),
      ::testing::HasSubstr("message 1, its part 0 (from 0): a part has an empty variable name"));
  EXPECT_EQ(State(0), State(1));
}

// A message that is not a RegisterRequest in the middle of a registration
// ends it with INVALID_ARGUMENT (gRPC's typed reader would have ended the
// stream there quietly, and the registration gone on without the rest).
TEST_F(MalformedRequestTest, UnparsableRegistrationMessageRegistersNothing) {
  RegisterRequest msg;
  RegisterHeader* h = msg.mutable_header();
  h->set_plan_fingerprint(Status(0).plan_fingerprint());
  h->set_num_shards(1);
  PartDef* def = h->add_parts();
  def->set_variable("fresh");
  def->add_variable_shape(2);
  def->set_row_end(2);
  Segment* s = msg.add_segments();
  s->set_variable("fresh");
  const float values[2] = {1, 2};
  s->set_data(std::string(reinterpret_cast<const char*>(values), 8));
  const CallResult got =
      Call(channels_[0].get(), Method::kRegister, {msg.SerializeAsString(), "\xff\xff\xff"});
  EXPECT_EQ(got.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(got.status.error_message(), ::testing::HasSubstr("message 1"));
  EXPECT_EQ(State(0), State(1));
}

// A push message that does not decode names its method and its place in
// the stream, and the push applies nothing.
TEST_F(MalformedRequestTest, UndecodablePushMessageIsNamedByMethodAndIndex) {
  PushRequest header;
  header.mutable_header()->set_worker_id(1);
  for (const auto& [method, name] :
       {std::pair{Method::kPush, "Push"}, std::pair{Method::kPushPull, "PushPull"}}) {
    const CallResult got = Call(channels_[0].get(), method,
                                {header.SerializeAsString(), std::string(), "\xff\xff\xff"});
    EXPECT_EQ(got.status.error_code(), grpc::INVALID_ARGUMENT) << name;
    EXPECT_THAT(got.status.error_message(),
                ::testing::HasSubstr(absl::StrCat(name, ": message 3 of the stream: malformed")));
  }
  EXPECT_EQ(State(0), State(1));
}

}  // namespace
}  // namespace psflow
