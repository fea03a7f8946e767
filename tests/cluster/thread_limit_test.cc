// The gRPC client when a thread cannot be started (a pid or memory limit,
// as in a container with a pids limit). This binary interposes
// pthread_create so that a test can refuse the next threads std::thread
// starts (gRPC's own threads are left alone): std::thread then throws, and
// the client must still finish the call, or fail it with a status, instead
// of ending the process.
#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "ps_server/grpc_ps_server.h"
#include "psflow.grpc.pb.h"
#include "tests/cluster/loopback_server.h"
#include "worker/backend.h"
#include "worker/data/batcher.h"
#include "worker/grpc_ps_client.h"
#include "worker/model/model_def.h"
#include "worker/trainer.h"

namespace {

std::atomic<int> g_refuse{0};   // std::thread starts still to refuse
std::atomic<int> g_refused{0};  // refused so far
// Refuses, besides, every std::thread start whose callable's type name
// contains this (a class of the code under test, whose lambda it runs);
// null: none.
std::atomic<const char*> g_refuse_callable{nullptr};

// True for a start routine of libstdc++ (std::thread's), not gRPC's.
bool StartedByStdThread(void* (*start)(void*)) {
  Dl_info info;
  return dladdr(reinterpret_cast<void*>(start), &info) != 0 && info.dli_fname != nullptr &&
         std::strstr(info.dli_fname, "libstdc++") != nullptr;
}

// True if the std::thread whose state `arg` is (libstdc++ passes its
// std::thread::_State to pthread_create) runs a callable whose mangled type
// name contains `part`.
bool CallableNamed(void* arg, const char* part) {
  const auto* state = static_cast<std::thread::_State*>(arg);
  return std::strstr(typeid(*state).name(), part) != nullptr;
}

}  // namespace

extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr,
                              void* (*start)(void*), void* arg) noexcept {
  using Create = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static const auto real = reinterpret_cast<Create>(dlsym(RTLD_NEXT, "pthread_create"));
  if (StartedByStdThread(start)) {
    const char* callable = g_refuse_callable.load();
    if (callable != nullptr && CallableNamed(arg, callable)) {
      g_refused.fetch_add(1);
      return EAGAIN;
    }
    int left = g_refuse.load();
    while (left > 0 && !g_refuse.compare_exchange_weak(left, left - 1)) {
    }
    if (left > 0) {
      g_refused.fetch_add(1);
      return EAGAIN;
    }
  }
  return real(thread, attr, start, arg);
}

namespace psflow {
namespace {

using server::OptimizerOptions;
using server::PsServer;
using server::PsServerOptions;
using worker::CreateGrpcPsClient;
using worker::GrpcPsClientOptions;
using worker::PsClient;

class ThreadLimitTest : public ::testing::Test {
 protected:
  // `num_shards` in-process shards with SGD at learning rate 1 (a value
  // moves by minus the sum of its gradients) and a client registering
  // `vars` at 0.
  void Start(int num_shards, const std::vector<VariableSpec>& vars) {
    GrpcPsClientOptions options;
    for (int s = 0; s < num_shards; ++s) {
      PsServerOptions server_options;
      server_options.address = "127.0.0.1:0";
      server_options.store.shard_index = s;
      server_options.store.num_shards = num_shards;
      server_options.store.optimizer.kind = OptimizerOptions::Kind::kSgd;
      server_options.store.optimizer.learning_rate = 1.0f;
      auto server = PsServer::Start(server_options);
      ASSERT_TRUE(server.ok()) << server.status();
      options.ps_addresses.push_back((*server)->client_address());
      servers_.push_back(std::move(*server));
    }
    options.min_split_bytes = 1024;  // "w" is split over the shards
    auto client = CreateGrpcPsClient(vars, options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    for (const VariableSpec& v : vars) zeros_.emplace_back(v.num_elements(), 0.0f);
    ASSERT_TRUE(client_->Register(Pointers<const float>(zeros_)).ok());
  }
  template <typename T>
  static std::vector<T*> Pointers(std::vector<std::vector<float>>& tensors) {
    std::vector<T*> out;
    for (auto& t : tensors) out.push_back(t.data());
    return out;
  }
  std::vector<std::vector<float>> Pulled() {
    std::vector<std::vector<float>> values = zeros_;
    EXPECT_TRUE(client_->Pull(Pointers<float>(values)).ok());
    return values;
  }

  std::vector<std::unique_ptr<PsServer>> servers_;
  std::unique_ptr<PsClient> client_;
  std::vector<std::vector<float>> zeros_;
};

// A push to two shards starts a thread for the second; refused, the second
// shard's push runs on the caller's thread after the first's.
TEST_F(ThreadLimitTest, PushWithoutAThreadPerShardStillReachesEveryShard) {
  const std::vector<VariableSpec> vars = {{"w", {1000}}, {"b", {10}}};
  Start(2, vars);
  ASSERT_EQ(client_->plan().num_shards(), 2);
  std::vector<std::vector<float>> grads = {std::vector<float>(1000, 1.0f),
                                           std::vector<float>(10, 2.0f)};
  g_refused = 0;
  g_refuse = 1;
  const absl::Status pushed = client_->Push(Pointers<const float>(grads), {1, 0});
  g_refuse = 0;
  EXPECT_TRUE(pushed.ok()) << pushed;
  EXPECT_EQ(g_refused.load(), 1) << "no thread was refused: the test tested nothing";
  const auto values = Pulled();
  EXPECT_EQ(values[0], std::vector<float>(1000, -1.0f));
  EXPECT_EQ(values[1], std::vector<float>(10, -2.0f));
}

// A PushPull needs a writer thread beside the reading one (the shard
// answers each message as it applies it); refused, that attempt fails
// UNAVAILABLE with nothing sent, and the retry applies the push once.
TEST_F(ThreadLimitTest, PushPullWithoutItsWriterThreadIsRetriedAndAppliedOnce) {
  const std::vector<VariableSpec> vars = {{"w", {100}}};
  Start(1, vars);
  std::vector<std::vector<float>> grads = {std::vector<float>(100, 3.0f)};
  std::vector<std::vector<float>> values = zeros_;
  g_refused = 0;
  g_refuse = 1;
  const auto result =
      client_->PushPull(Pointers<const float>(grads), {1, 0}, Pointers<float>(values));
  g_refuse = 0;
  EXPECT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(g_refused.load(), 1) << "no thread was refused: the test tested nothing";
  EXPECT_EQ(values[0], std::vector<float>(100, -3.0f));
  EXPECT_EQ(Pulled()[0], std::vector<float>(100, -3.0f));
}

// A shard that accepts every Push without applying it, noting the deadline
// each call arrived with; the first call is answered only after `delay`.
class DeadlineRecordingShard final : public ParameterServer::Service {
 public:
  explicit DeadlineRecordingShard(absl::Duration delay) : delay_(delay) {}
  grpc::Status Push(grpc::ServerContext* context, grpc::ServerReader<PushRequest>* reader,
                    PushResponse*) override {
    PushRequest msg;
    while (reader->Read(&msg)) {
    }
    bool first = false;
    {
      absl::MutexLock lock(&mu_);
      first = deadlines_.empty();
      deadlines_.push_back(absl::FromChrono(context->deadline()));
    }
    if (first) absl::SleepFor(delay_);
    return grpc::Status::OK;
  }
  std::vector<absl::Time> deadlines() {
    absl::MutexLock lock(&mu_);
    return deadlines_;
  }

 private:
  const absl::Duration delay_;
  absl::Mutex mu_;
  std::vector<absl::Time> deadlines_ ABSL_GUARDED_BY(mu_);
};

// A push split over two connections whose second stream cannot have a
// thread runs that stream after the first on the caller's thread. It must
// keep the attempt's deadline rather than start a fresh one: the push's
// retry window assumes that no attempt outlasts rpc_timeout, after which
// a shard that forgot the request id would apply a late retry twice.
TEST(ThreadLimitDeadlineTest, StreamsRunOneAfterAnotherShareTheAttemptsDeadline) {
  // (3 s: the check below allows half of it for a call's way to the server
  // on a loaded machine, where a second deadline of its own is `delay` off.)
  const absl::Duration delay = absl::Seconds(3);
  DeadlineRecordingShard shard(delay);
  std::string address;
  std::unique_ptr<grpc::Server> server = test_support::ServeOnLoopback(&shard, &address);
  ASSERT_NE(server, nullptr);
  GrpcPsClientOptions options;
  options.ps_addresses = {address};
  options.streams_per_shard = 2;
  options.max_chunk_bytes = 64;  // 4 messages: 2 per stream
  options.rpc_timeout = absl::Seconds(30);
  auto client = CreateGrpcPsClient({{"w", {64}}}, options);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<float> grad(64, 1.0f);
  const std::vector<const float*> grads = {grad.data()};
  g_refused = 0;
  g_refuse = 1;
  const absl::Status pushed = (*client)->Push(grads, {1, 0});
  g_refuse = 0;
  EXPECT_TRUE(pushed.ok()) << pushed;
  EXPECT_EQ(g_refused.load(), 1) << "no thread was refused: the streams ran in parallel";
  const std::vector<absl::Time> deadlines = shard.deadlines();
  ASSERT_EQ(deadlines.size(), 2u);
  // The second stream started `delay` after the first; a deadline of its
  // own would end that much later (the tolerance allows for the time a
  // call takes to reach the server on a loaded machine).
  EXPECT_LT(absl::AbsDuration(deadlines[1] - deadlines[0]), delay / 2)
      << "the second stream's deadline is " << deadlines[1] - deadlines[0] << " after the first's";
  server->Shutdown();
}

// The worker's batcher, whose thread could not be started, fails its
// creation with a status naming the data set (it ended the process with
// std::thread's exception).
TEST(ThreadLimitBatcherTest, BatcherWithoutItsThreadIsRefused) {
  worker::Dataset data;
  data.name = "squares/train";
  data.height = data.width = data.channels = 1;
  data.num_examples = 8;
  data.pixels.assign(8, 1);
  data.labels.assign(8, 0);
  worker::BatcherOptions options;
  options.batch_size = 4;
  g_refused = 0;
  g_refuse = 1;
  auto refused = worker::Batcher::Create(&data, options);
  g_refuse = 0;
  EXPECT_EQ(g_refused.load(), 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("could not start the thread that assembles the batches of "
                                   "squares/train"));
  auto made = worker::Batcher::Create(&data, options);
  ASSERT_TRUE(made.ok()) << made.status();
}

// The trainer, whose thread for pushes and pulls could not be started, fails
// with a status that says so, after the batcher's thread started and the
// model was registered; nothing is left running (it ended the process with
// std::thread's exception before 6618a87).
TEST(ThreadLimitTrainerTest, TrainerWithoutItsCommThreadIsRefused) {
  auto model = worker::ParseModel("flatten,dense:2", {2, 2, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  auto backend = worker::CreateBackend("cpu", {});
  ASSERT_TRUE(backend.ok()) << backend.status();
  ASSERT_TRUE((*backend)->Prepare(*model, 4).ok());
  worker::Dataset data;
  data.name = "corners";
  data.height = data.width = 2;
  data.channels = 1;
  data.num_classes = 2;
  data.num_examples = 8;
  for (int i = 0; i < 8; ++i) {
    data.labels.push_back(i % 2);
    for (int p = 0; p < 4; ++p) data.pixels.push_back(p == i % 2 ? 255 : 0);
  }
  PsServerOptions server_options;
  server_options.address = "127.0.0.1:0";
  auto server = PsServer::Start(server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  GrpcPsClientOptions client_options;
  client_options.ps_addresses = {(*server)->client_address()};
  auto client = CreateGrpcPsClient(model->variables, client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  worker::TrainerOptions options;
  options.batch_size = 4;
  options.epochs = 1;
  options.progress = nullptr;

  g_refused = 0;
  g_refuse_callable = "CommThread";
  auto refused = worker::Train(*model, backend->get(), client->get(), data, data, options);
  g_refuse_callable = nullptr;
  EXPECT_EQ(g_refused.load(), 1) << "no thread was refused: the test tested nothing";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("could not start the worker's thread for pushes and pulls"));
  // The same worker then trains: the refusal left the model registered and
  // nothing behind that a second run trips over.
  auto trained = worker::Train(*model, backend->get(), client->get(), data, data, options);
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_EQ(trained->steps, 2);
}

}  // namespace
}  // namespace psflow
