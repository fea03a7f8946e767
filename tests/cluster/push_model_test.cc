// Random pushes against a model of the exactly-once rule. A shard (SGD with
// learning rate 1, so a parameter moves by exactly minus its gradients, which
// small integers keep exact) gets hundreds of random Push and PushPull calls:
// fresh, reused and zero (unprotected) request ids, overlapping and repeated
// segments, empty segments and messages, and now and then a bad segment
// (unknown variable, range outside the part, an offset near the int64 limit,
// NaN or Inf, a partial float). After every call its status, its counts or
// answered values, and then every parameter and part version are compared
// with what the rule in proto/psflow.proto says, and so is a random Pull
// (every part, some variables or some ranges, good and bad, in chunks of
// random size):
//   * a message with a bad segment is refused whole and ends the push; the
//     messages before it stay applied, nothing after it is read;
//   * each element of a part is updated at most once per request id;
//   * a part's version advances once per request id that updates any of its
//     elements;
//   * PushPull answers each message with its segments' values and versions
//     right after each segment is applied (an empty message or segment
//     included).
// Both ways a shard applies pushes run: on the reading thread and on a pool
// of applier threads (where the messages of one push apply in parallel).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "ps_server/grpc_ps_server.h"
#include "psflow.grpc.pb.h"
#include "worker/grpc_ps_client.h"

namespace psflow {
namespace {

using server::PsServer;
using server::PsServerOptions;

const std::vector<VariableSpec>& Vars() {
  static const auto* vars =
      new std::vector<VariableSpec>{{"a", {64}}, {"b", {5}}, {"c", {3, 7}}};
  return *vars;
}

// One segment as sent, and the status the shard must answer it with.
struct SentSegment {
  int var = -1;  // index into Vars(), -1 for an unknown variable
  int64_t offset = 0;
  std::vector<float> values;  // the gradient when the segment is good
  bool partial_float = false;  // 1 to 3 stray bytes after the values
  grpc::StatusCode code = grpc::OK;
};

// The shard as the rule describes it.
class Model {
 public:
  explicit Model(std::vector<std::vector<float>> values) : values_(std::move(values)) {
    versions_.assign(values_.size(), 0);
  }

  // Applies a good message under `id`, segment by segment; adds to the
  // counts of applied and skipped elements, and appends each segment's part
  // version right after it to `*versions`.
  void Apply(uint64_t id, const std::vector<SentSegment>& msg, int64_t* applied,
             int64_t* skipped, std::vector<int64_t>* versions) {
    for (const SentSegment& s : msg) {
      std::vector<bool>& done = Done(id, s.var);
      // The part steps with the first element the id applies to it.
      const bool stepped = std::find(done.begin(), done.end(), true) != done.end();
      bool any = false;
      for (size_t i = 0; i < s.values.size(); ++i) {
        const size_t e = static_cast<size_t>(s.offset) + i;
        if (done[e]) {
          ++*skipped;
          continue;
        }
        done[e] = true;
        values_[s.var][e] -= s.values[i];
        ++*applied;
        any = true;
      }
      if (any && !stepped) ++versions_[s.var];
      versions->push_back(versions_[s.var]);
    }
  }

  const std::vector<std::vector<float>>& values() const { return values_; }
  int64_t version(int var) const { return versions_[var]; }

 private:
  std::vector<bool>& Done(uint64_t id, int var) {
    auto& per_var = done_[id];
    if (per_var.empty()) {
      for (const auto& v : values_) per_var.emplace_back(v.size(), false);
    }
    return per_var[var];
  }

  std::vector<std::vector<float>> values_;
  std::vector<int64_t> versions_;
  std::map<uint64_t, std::vector<std::vector<bool>>> done_;
};

class PushModelTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    PsServerOptions options;
    options.address = "127.0.0.1:0";
    options.store.optimizer.kind = server::OptimizerOptions::Kind::kSgd;
    options.store.optimizer.learning_rate = 1.0f;
    options.apply_threads = GetParam();
    auto server = PsServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    worker::GrpcPsClientOptions client_options;
    client_options.ps_addresses = {server_->client_address()};
    client_options.rpc_timeout = absl::Seconds(30);
    auto client = worker::CreateGrpcPsClient(Vars(), client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    stub_ = ParameterServer::NewStub(
        grpc::CreateChannel(server_->client_address(), grpc::InsecureChannelCredentials()));
  }

  static std::string Name(int var) { return var < 0 ? "zz" : Vars()[var].name; }

  // A random segment: mostly good ones, each bad kind now and then.
  // `grads[v][e]` is the gradient any segment of this call carries for
  // element e of variable v: a push carries one value per element (a
  // client's retry, or its split over several streams, sends the same
  // values), and which of two overlapping segments of one push is applied
  // first is not fixed when the shard applies messages in parallel.
  static SentSegment RandomSegment(std::mt19937_64& rng,
                                   const std::vector<std::vector<float>>& grads) {
    auto uniform = [&](int64_t lo, int64_t hi) {  // [lo, hi]
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    SentSegment s;
    s.var = static_cast<int>(uniform(0, static_cast<int64_t>(Vars().size()) - 1));
    const int64_t n = Vars()[s.var].num_elements();
    s.offset = uniform(0, n);
    const int64_t count = uniform(0, std::min<int64_t>(n - s.offset, 24));
    s.values.assign(grads[s.var].begin() + s.offset, grads[s.var].begin() + s.offset + count);
    switch (uniform(0, 99)) {
      case 0:
        s.var = -1;
        s.code = grpc::NOT_FOUND;
        break;
      case 1:  // one element past the end of the part
        s.offset = n - static_cast<int64_t>(s.values.size()) + 1;
        s.code = grpc::INVALID_ARGUMENT;
        break;
      case 2:
        s.offset = -uniform(1, 3);
        s.code = grpc::INVALID_ARGUMENT;
        break;
      case 3:
        s.offset = std::numeric_limits<int64_t>::max() - uniform(0, 2);
        if (s.values.empty()) s.values.push_back(1);
        s.code = grpc::INVALID_ARGUMENT;
        break;
      case 4:
        if (s.values.empty()) s.values.push_back(1);
        s.values[uniform(0, static_cast<int64_t>(s.values.size()) - 1)] =
            uniform(0, 1) ? std::numeric_limits<float>::quiet_NaN()
                          : -std::numeric_limits<float>::infinity();
        s.code = grpc::INVALID_ARGUMENT;
        break;
      case 5:
        s.partial_float = true;
        s.code = grpc::INVALID_ARGUMENT;
        break;
      default:
        break;
    }
    return s;
  }

  static PushRequest ToProto(const std::vector<SentSegment>& msg, std::mt19937_64& rng) {
    PushRequest m;
    for (const SentSegment& s : msg) {
      Segment* seg = m.add_segments();
      seg->set_variable(Name(s.var));
      seg->set_offset(s.offset);
      std::string data(reinterpret_cast<const char*>(s.values.data()), s.values.size() * 4);
      if (s.partial_float) data.append(1 + rng() % 3, '\x01');
      seg->set_data(data);
    }
    return m;
  }

  // Checks every parameter and version against the model.
  void ExpectShardMatches(const Model& model) {
    std::vector<std::vector<float>> got;
    std::vector<float*> ptrs;
    for (const auto& v : Vars()) got.emplace_back(v.num_elements(), -99.0f);
    for (auto& g : got) ptrs.push_back(g.data());
    ASSERT_TRUE(client_->Pull(ptrs).ok());
    for (size_t v = 0; v < Vars().size(); ++v) {
      ASSERT_EQ(got[v], model.values()[v]) << "values of " << Vars()[v].name;
    }
    auto status = client_->GetStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->size(), 1u);
    for (const PartStatus& part : (*status)[0].parts()) {
      int var = -1;
      for (size_t v = 0; v < Vars().size(); ++v) {
        if (Vars()[v].name == part.def().variable()) var = static_cast<int>(v);
      }
      ASSERT_GE(var, 0) << part.def().variable();
      ASSERT_EQ(part.version(), model.version(var)) << "version of " << part.def().variable();
    }
  }

  // A random Pull (every part, some variables, or ranges, now and then a
  // bad one; a random chunk size) read raw: its status, and the segments
  // of its answers in order, with the model's values and versions, each
  // answer within the chunk size.
  void CheckRandomPull(std::mt19937_64& rng, const Model& model) {
    PullRequest request;
    struct Span {
      int var;
      int64_t begin, end;
    };
    std::vector<Span> spans;
    std::set<grpc::StatusCode> allowed;
    const int kind = static_cast<int>(rng() % 3);
    if (kind == 0) {
      for (size_t v = 0; v < Vars().size(); ++v) {  // the shard lists its parts by name
        spans.push_back({static_cast<int>(v), 0, Vars()[v].num_elements()});
      }
    } else if (kind == 1) {
      for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
        int var = static_cast<int>(rng() % (Vars().size() + 1)) - 1;  // -1: unknown
        if (var < 0 && rng() % 3 != 0) var = 0;                        // not too often
        request.add_variables(Name(var));
        if (var < 0) allowed.insert(grpc::NOT_FOUND);
        if (var >= 0) spans.push_back({var, 0, Vars()[var].num_elements()});
      }
    } else {
      for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
        const int var = static_cast<int>(rng() % Vars().size());
        const int64_t size = Vars()[var].num_elements();
        int64_t offset = static_cast<int64_t>(rng() % (size + 1));
        int64_t count = static_cast<int64_t>(rng() % (size - offset + 1));
        std::string name = Name(var);
        switch (rng() % 25) {
          case 0:
            name = Name(-1);
            allowed.insert(grpc::NOT_FOUND);
            break;
          case 1:
            count = size - offset + 1;
            allowed.insert(grpc::INVALID_ARGUMENT);
            break;
          case 2:
            offset = std::numeric_limits<int64_t>::max();
            count = 1;
            allowed.insert(grpc::INVALID_ARGUMENT);
            break;
          case 3:
            count = -1;
            allowed.insert(grpc::INVALID_ARGUMENT);
            break;
          default:
            spans.push_back({var, offset, offset + count});
        }
        PullRange* range = request.add_ranges();
        range->set_variable(name);
        range->set_offset(offset);
        range->set_count(count);
      }
    }
    const int64_t chunks[] = {0, -8, 4, 6, 8 + static_cast<int64_t>(rng() % 200), 1 << 20};
    request.set_max_chunk_bytes(chunks[rng() % 6]);
    // What each answer may weigh, framing included (the server's limit is
    // its default 4 MiB, above every size asked for here).
    const int64_t budget =
        request.max_chunk_bytes() > 0 ? std::max<int64_t>(4, request.max_chunk_bytes()) : 1 << 20;
    SCOPED_TRACE(absl::StrCat("Pull ", request.ShortDebugString()));

    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub_->Pull(&context, request);
    std::vector<PullResponse> answers;
    PullResponse answer;
    while (reader->Read(&answer)) answers.push_back(answer);
    const grpc::Status status = reader->Finish();
    if (!allowed.empty()) {
      EXPECT_TRUE(allowed.count(status.error_code()) > 0)
          << "status " << status.error_code() << ": " << status.error_message();
      EXPECT_TRUE(answers.empty()) << "values were sent for a refused Pull";
      return;
    }
    ASSERT_TRUE(status.ok()) << status.error_message();
    // Every element of every span, in order, in as many segments as needed.
    size_t span = 0;
    int64_t at = 0;
    auto skip_empty = [&] {
      while (span < spans.size() && spans[span].begin + at == spans[span].end) {
        ++span;
        at = 0;
      }
    };
    skip_empty();
    for (const PullResponse& a : answers) {
      ASSERT_EQ(a.versions_size(), a.segments_size());
      int64_t elements = 0;
      for (int i = 0; i < a.segments_size(); ++i) {
        const Segment& seg = a.segments(i);
        ASSERT_LT(span, spans.size()) << "more values than asked for";
        const Span& want = spans[span];
        ASSERT_EQ(seg.variable(), Name(want.var));
        ASSERT_EQ(seg.offset(), want.begin + at);
        const int64_t n = static_cast<int64_t>(seg.data().size() / 4);
        ASSERT_GT(n, 0) << "empty segment";
        ASSERT_LE(seg.offset() + n, want.end);
        std::vector<float> values(n);
        std::memcpy(values.data(), seg.data().data(), n * 4);
        const auto& now = model.values()[want.var];
        EXPECT_TRUE(std::equal(values.begin(), values.end(), now.begin() + seg.offset()))
            << Name(want.var) << " at " << seg.offset();
        EXPECT_EQ(a.versions(i), model.version(want.var));
        elements += n;
        at += n;
        skip_empty();
      }
      // Over the budget only where one segment's framing alone is.
      if (!(a.segments_size() == 1 && elements == 1)) {
        EXPECT_LE(static_cast<int64_t>(a.ByteSizeLong()), budget)
            << "an answer larger than the chunk size asked for, framing included";
      }
    }
    EXPECT_EQ(span, spans.size()) << "fewer values than asked for";
  }

  std::unique_ptr<PsServer> server_;
  std::unique_ptr<worker::PsClient> client_;
  std::unique_ptr<ParameterServer::Stub> stub_;
};

TEST_P(PushModelTest, RandomPushesFollowTheExactlyOnceRule) {
  std::mt19937_64 rng(20261205 + GetParam());
  std::vector<std::vector<float>> init;
  for (const auto& v : Vars()) {
    init.emplace_back();
    for (int64_t i = 0; i < v.num_elements(); ++i) init.back().push_back(static_cast<float>(i % 7));
  }
  std::vector<const float*> init_ptrs;
  for (const auto& v : init) init_ptrs.push_back(v.data());
  ASSERT_TRUE(client_->Register(init_ptrs).ok());
  Model model(init);

  std::vector<uint64_t> ids;
  int refused = 0, retried = 0, unprotected = 0, fused_calls = 0;
  constexpr int kCalls = 400;
  for (int call = 0; call < kCalls; ++call) {
    // A fresh request id, or (two times in five) one used before, or (one
    // time in ten) 0: no retry protection, the call is a push of its own
    // (the model keeps it under an even key no other id has).
    uint64_t id, model_id;
    const int pick = static_cast<int>(rng() % 10);
    if (pick == 0) {
      id = 0;
      model_id = 2 * (static_cast<uint64_t>(call) + 1);
      ++unprotected;
    } else if (!ids.empty() && pick <= 4) {
      id = model_id = ids[rng() % ids.size()];
      ++retried;
    } else {
      id = model_id = rng() | 1;
      ids.push_back(id);
    }
    std::vector<std::vector<float>> grads;
    for (const auto& v : Vars()) {
      grads.emplace_back();
      for (int64_t i = 0; i < v.num_elements(); ++i) {
        grads.back().push_back(static_cast<float>(static_cast<int>(rng() % 7) - 3));
      }
    }
    std::vector<std::vector<SentSegment>> msgs(1 + rng() % 4);
    for (auto& msg : msgs) {
      const int segments = static_cast<int>(rng() % 4);  // 0: an empty message
      for (int s = 0; s < segments; ++s) msg.push_back(RandomSegment(rng, grads));
    }
    const bool fused = rng() % 2 == 0;
    fused_calls += fused;
    SCOPED_TRACE(absl::StrCat("call ", call, fused ? " (PushPull)" : " (Push)", ", ",
                              msgs.size(), " messages, request id ", id));

    // What the rule says: messages apply in order up to the first bad one.
    int64_t applied = 0, skipped = 0;
    std::set<grpc::StatusCode> allowed;  // a bad message names any of its bad segments
    // Per good message, each segment's part version right after it.
    std::vector<std::vector<int64_t>> versions;
    for (const auto& msg : msgs) {
      for (const SentSegment& s : msg) {
        if (s.code != grpc::OK) allowed.insert(s.code);
      }
      if (!allowed.empty()) break;
      model.Apply(model_id, msg, &applied, &skipped, &versions.emplace_back());
    }
    const size_t good_messages = versions.size();
    if (allowed.empty()) allowed.insert(grpc::OK);
    refused += allowed.count(grpc::OK) == 0;

    std::vector<PushRequest> protos;
    for (const auto& msg : msgs) protos.push_back(ToProto(msg, rng));
    protos[0].mutable_header()->set_request_id(id);
    protos[0].mutable_header()->set_worker_id(3);
    protos[0].mutable_header()->set_step(call);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status status;
    if (!fused) {
      PushResponse response;
      auto writer = stub_->Push(&context, &response);
      for (const auto& m : protos) {
        if (!writer->Write(m)) break;
      }
      writer->WritesDone();
      status = writer->Finish();
      if (status.ok()) {
        EXPECT_EQ(response.elements_applied(), applied);
        EXPECT_EQ(response.elements_skipped(), skipped);
      }
    } else {
      auto stream = stub_->PushPull(&context);
      for (const auto& m : protos) {
        if (!stream->Write(m)) break;
      }
      stream->WritesDone();
      std::vector<PullResponse> answers;
      PullResponse answer;
      while (stream->Read(&answer)) answers.push_back(answer);
      status = stream->Finish();
      // One answer per applied message, with the same segments, carrying
      // the values and versions right after each segment.
      EXPECT_LE(answers.size(), good_messages);
      if (status.ok()) {
        EXPECT_EQ(answers.size(), msgs.size());
      }
      for (size_t k = 0; k < answers.size() && k < msgs.size(); ++k) {
        const PullResponse& a = answers[k];
        ASSERT_EQ(a.segments_size(), static_cast<int>(msgs[k].size())) << "answer " << k;
        ASSERT_EQ(a.versions_size(), a.segments_size()) << "answer " << k;
        for (int s = 0; s < a.segments_size(); ++s) {
          const SentSegment& sent = msgs[k][s];
          const Segment& seg = a.segments(s);
          EXPECT_EQ(seg.variable(), Name(sent.var));
          EXPECT_EQ(seg.offset(), sent.offset);
          ASSERT_EQ(seg.data().size(), sent.values.size() * 4) << "answer " << k << " segment " << s;
          std::vector<float> values(sent.values.size());
          if (!values.empty()) std::memcpy(values.data(), seg.data().data(), seg.data().size());
          // Later messages of the push skip what this one applied.
          const auto& now = model.values()[sent.var];
          EXPECT_TRUE(std::equal(values.begin(), values.end(), now.begin() + sent.offset))
              << "answer " << k << " segment " << s << " values";
          EXPECT_EQ(a.versions(s), versions[k][s]) << "answer " << k << " segment " << s;
        }
      }
    }
    EXPECT_TRUE(allowed.count(status.error_code()) > 0)
        << "status " << status.error_code() << ": " << status.error_message();
    ExpectShardMatches(model);
    CheckRandomPull(rng, model);
    if (HasFailure()) {  // one failing call is enough to read
      std::string what;
      for (size_t k = 0; k < msgs.size(); ++k) {
        absl::StrAppend(&what, "message ", k, ":");
        for (const SentSegment& s : msgs[k]) {
          absl::StrAppend(&what, " ", Name(s.var), "@", s.offset, "+", s.values.size(),
                          s.partial_float ? "(+stray bytes)" : "", " code ", s.code, " [",
                          absl::StrJoin(s.values, ","), "]");
        }
        absl::StrAppend(&what, "\n");
      }
      ADD_FAILURE() << "the failing call sent:\n" << what << "and got status "
                    << status.error_code() << " " << status.error_message();
      break;
    }
  }
  // The run exercised what it is for.
  EXPECT_GT(refused, kCalls / 20);
  EXPECT_GT(retried, kCalls / 5);
  EXPECT_GT(unprotected, kCalls / 20);
  EXPECT_GT(fused_calls, kCalls / 4);
}

INSTANTIATE_TEST_SUITE_P(ApplyThreads, PushModelTest, ::testing::Values(0, 2),
                         [](const auto& info) {
                           return info.param == 0 ? std::string("OnTheReadingThread")
                                                  : absl::StrCat(info.param, "Appliers");
                         });

}  // namespace
}  // namespace psflow
