// In-process training: two PS shards on loopback ports and two worker
// threads running the real training loop over real gRPC, on a generated
// data set that a small CNN can learn.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps_server/grpc_ps_server.h"
#include "worker/backend.h"
#include "worker/grpc_ps_client.h"
#include "worker/progress.h"
#include "worker/trainer.h"

namespace psflow {
namespace {

using worker::Dataset;

// 10 classes of 8x8 images: class c lights up a 3x3 square at a fixed,
// class-specific position, plus noise; the label is learnable, chance is 0.1.
Dataset MakeSquares(int n, uint32_t seed) {
  Dataset d;
  d.name = "squares";
  d.height = d.width = 8;
  d.channels = 1;
  d.num_classes = 10;
  d.num_examples = n;
  d.pixels.resize(static_cast<size_t>(n) * 64);
  d.labels.resize(n);
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> noise(0, 60);
  for (int i = 0; i < n; ++i) {
    const int c = i % 10;
    d.labels[i] = c;
    const int r0 = (c / 4) * 2 + 1, c0 = (c % 4) * 2;
    for (int y = 0; y < 8; ++y) {
      for (int x = 0; x < 8; ++x) {
        const bool on = y >= r0 && y < r0 + 3 && x >= c0 && x < c0 + 3;
        d.pixels[i * 64 + y * 8 + x] = static_cast<uint8_t>(on ? 255 - noise(gen) : noise(gen));
      }
    }
  }
  return d;
}

// With the fused PushPull call (the default) and with a Push then a Pull.
class TrainingClusterTest : public ::testing::TestWithParam<bool> {};

TEST_P(TrainingClusterTest, TwoWorkersLearnOverRealGrpc) {
  std::vector<std::unique_ptr<server::PsServer>> servers;
  std::vector<std::string> addresses;
  for (int s = 0; s < 2; ++s) {
    server::PsServerOptions options;
    options.address = "127.0.0.1:0";
    options.store.shard_index = s;
    options.store.num_shards = 2;
    options.store.optimizer.learning_rate = 0.01f;  // Adam
    auto server = server::PsServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    addresses.push_back((*server)->client_address());
    servers.push_back(std::move(*server));
  }
  const Dataset train = MakeSquares(2000, 1), test = MakeSquares(500, 2);
  auto model = worker::ParseModel("conv2d:4:3:relu,flatten,dense:16:relu,dense:10", {8, 8, 1});
  ASSERT_TRUE(model.ok()) << model.status();

  std::vector<absl::StatusOr<worker::TrainSummary>> results(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      auto backend = worker::CreateBackend("cpu", {});
      if (!backend.ok()) {
        results[w] = backend.status();
        return;
      }
      if (auto s = (*backend)->Prepare(*model, 32); !s.ok()) {
        results[w] = s;
        return;
      }
      worker::GrpcPsClientOptions client_options;
      client_options.ps_addresses = addresses;
      client_options.worker_id = w;
      // Small variables: split them anyway so both shards take part.
      client_options.min_split_bytes = 1024;
      auto client = worker::CreateGrpcPsClient(model->variables, client_options);
      if (!client.ok()) {
        results[w] = client.status();
        return;
      }
      worker::TrainerOptions options;
      options.replica_index = w;
      options.num_replicas = 2;
      options.is_chief = w == 0;
      options.batch_size = 32;
      options.epochs = 4;
      options.seed = 3;
      options.progress = nullptr;
      options.wait_for_variables = absl::Seconds(30);
      options.fused_push_pull = GetParam();
      results[w] = worker::Train(*model, backend->get(), client->get(), train, test, options);
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < 2; ++w) {
    ASSERT_TRUE(results[w].ok()) << "worker " << w << ": " << results[w].status();
    const worker::TrainSummary& s = *results[w];
    // Each worker did its shard: 1000 examples = 32 batches per epoch.
    EXPECT_EQ(s.steps, 4 * 32);
    EXPECT_EQ(s.examples, 4 * 1000);
    EXPECT_GT(s.test_accuracy, 0.8) << "worker " << w << " (chance is 0.1)";
    // The communication went through the calls asked for.
    EXPECT_EQ(s.push_pull_s > 0, GetParam());
    EXPECT_EQ(s.push_s > 0, !GetParam());
  }
  const auto& chief = *results[0];
  ASSERT_EQ(chief.epochs.size(), 4u);
  EXPECT_LT(chief.epochs.back().train_loss, 0.5 * chief.epochs.front().train_loss);
  EXPECT_LT(chief.epochs.front().train_loss, 2.5);  // started near ln(10) = 2.30
  // Every epoch of the chief was evaluated.
  for (const auto& e : chief.epochs) EXPECT_GE(e.test_accuracy, 0.0);

  // Both workers' pushes reached both shards.
  for (auto& server : servers) {
    const auto stats = server->store().stats();
    EXPECT_EQ(stats.pushes, 2 * 4 * 32);
    EXPECT_EQ(stats.rejected_requests, 0);
  }
}

// 6 steps of batch 32, quietly.
worker::TrainerOptions SixSteps() {
  worker::TrainerOptions options;
  options.batch_size = 32;
  options.epochs = 1;
  options.train_steps = 6;
  options.seed = 3;
  options.progress = nullptr;
  return options;
}

// Wraps a backend and records what the trainer pins: every step's big
// tensors must lie in pinned memory, and everything pinned must be unpinned
// before Train returns (a GPU backend copies straight from and to it).
class RecordingBackend : public worker::ComputeBackend {
 public:
  RecordingBackend(std::unique_ptr<worker::ComputeBackend> inner, bool refuse_pins)
      : inner_(std::move(inner)), refuse_pins_(refuse_pins) {}
  std::string name() const override { return "recording"; }
  absl::Status Prepare(const worker::ModelDef& model, int max_batch) override {
    model_ = model;
    return inner_->Prepare(model, max_batch);
  }
  absl::Status TrainStep(absl::Span<const float* const> params, const float* images,
                         const int32_t* labels, int batch, absl::Span<float* const> grads,
                         worker::StepResult* result) override {
    for (size_t v = 0; v < params.size(); ++v) {
      const size_t bytes = model_.variables[v].num_elements() * sizeof(float);
      if (bytes < 256 * 1024) continue;
      ++big_tensors_seen;
      if (Pinned(params[v], bytes) && Pinned(grads[v], bytes)) ++big_tensors_pinned;
    }
    return inner_->TrainStep(params, images, labels, batch, grads, result);
  }
  absl::Status Evaluate(absl::Span<const float* const> params, const float* images,
                        const int32_t* labels, int batch, worker::StepResult* result) override {
    return inner_->Evaluate(params, images, labels, batch, result);
  }
  absl::Status PinHostMemory(void* data, size_t bytes) override {
    ++pin_calls;
    if (refuse_pins_) return absl::FailedPreconditionError("refused by the test");
    pinned_.emplace_back(static_cast<char*>(data), bytes);
    return absl::OkStatus();
  }
  void UnpinHostMemory(void* data) override {
    ++unpin_calls;
    for (size_t i = 0; i < pinned_.size(); ++i) {
      if (pinned_[i].first == data) {
        pinned_.erase(pinned_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }
    ++unknown_unpins;
  }
  size_t still_pinned() const { return pinned_.size(); }

  int pin_calls = 0, unpin_calls = 0, unknown_unpins = 0;
  int64_t big_tensors_seen = 0, big_tensors_pinned = 0;

 private:
  bool Pinned(const void* p, size_t bytes) const {
    const char* c = static_cast<const char*>(p);
    for (const auto& [start, size] : pinned_) {
      if (c >= start && c + bytes <= start + size) return true;
    }
    return false;
  }
  std::unique_ptr<worker::ComputeBackend> inner_;
  const bool refuse_pins_;
  worker::ModelDef model_;
  std::vector<std::pair<char*, size_t>> pinned_;
};

TEST(TrainerPinningTest, BigTensorsArePinnedForEveryStepAndUnpinnedAtTheEnd) {
  server::PsServerOptions ps;
  ps.address = "127.0.0.1:0";
  auto server = server::PsServer::Start(ps);
  ASSERT_TRUE(server.ok()) << server.status();
  const Dataset train = MakeSquares(400, 1), test = MakeSquares(100, 2);
  // dense/kernel: 64 x 1024 floats = 256 KiB, the smallest size the trainer
  // pins; the others stay staged.
  auto model = worker::ParseModel("flatten,dense:1024:relu,dense:10", {8, 8, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  for (bool refuse : {false, true}) {
    SCOPED_TRACE(refuse ? "backend refuses to pin" : "backend pins");
    auto inner = worker::CreateBackend("cpu", {});
    ASSERT_TRUE(inner.ok()) << inner.status();
    RecordingBackend backend(std::move(*inner), refuse);
    ASSERT_TRUE(backend.Prepare(*model, 32).ok());
    worker::GrpcPsClientOptions client_options;
    client_options.ps_addresses = {(*server)->client_address()};
    auto client = worker::CreateGrpcPsClient(model->variables, client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    auto summary = worker::Train(*model, &backend, client->get(), train, test, SixSteps());
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->steps, 6);
    // Two parameter and two gradient buffers, one big tensor each.
    EXPECT_EQ(backend.pin_calls, 4);
    EXPECT_EQ(backend.big_tensors_seen, 6);
    EXPECT_EQ(backend.big_tensors_pinned, refuse ? 0 : 6);
    EXPECT_EQ(backend.unpin_calls, refuse ? 0 : 4);
    EXPECT_EQ(backend.unknown_unpins, 0);
    EXPECT_EQ(backend.still_pinned(), 0u);
  }
}

// One shard on a loopback port, a CPU backend prepared for `model` at batch
// 32, and a client of the shard.
struct OneShard {
  std::unique_ptr<server::PsServer> server;
  std::unique_ptr<worker::ComputeBackend> backend;
  std::unique_ptr<worker::PsClient> client;
};
absl::StatusOr<OneShard> StartOneShard(const worker::ModelDef& model) {
  OneShard out;
  server::PsServerOptions ps;
  ps.address = "127.0.0.1:0";
  PSFLOW_ASSIGN_OR_RETURN(out.server, server::PsServer::Start(ps));
  PSFLOW_ASSIGN_OR_RETURN(out.backend, worker::CreateBackend("cpu", {}));
  PSFLOW_RETURN_IF_ERROR(out.backend->Prepare(model, 32));
  worker::GrpcPsClientOptions client_options;
  client_options.ps_addresses = {out.server->client_address()};
  PSFLOW_ASSIGN_OR_RETURN(out.client, worker::CreateGrpcPsClient(model.variables, client_options));
  return out;
}

// A client that forwards to a real one, but whose third push says gRPC
// still holds the gradient (as the gRPC client does when gRPC has not let
// go of it a whole deadline after the calls ended).
class StillHeldClient : public worker::PsClient {
 public:
  // hold_at: the push that says so (3: the third), 0 for none.
  explicit StillHeldClient(std::unique_ptr<worker::PsClient> inner, int hold_at = 3)
      : inner_(std::move(inner)), hold_at_(hold_at) {}
  const PartitionPlan& plan() const override { return inner_->plan(); }
  absl::StatusOr<worker::RegisterResult> Register(
      absl::Span<const float* const> initial_values) override {
    return inner_->Register(initial_values);
  }
  absl::Status WaitForVariables(absl::Duration timeout,
                                const WaitingFn& waiting = nullptr) override {
    return inner_->WaitForVariables(timeout, waiting);
  }
  absl::StatusOr<worker::PullResult> Pull(absl::Span<float* const> values) override {
    return inner_->Pull(values);
  }
  absl::Status Push(absl::Span<const float* const> grads, const worker::PushInfo& info) override {
    Record(grads);
    if (hold_at_ == 0 || pushes_ < hold_at_) return inner_->Push(grads, info);
    held = {grads.begin(), grads.end()};
    for (size_t v = 0; v < grads.size(); ++v) {
      held_values.emplace_back(grads[v], grads[v] + plan().variables()[v].num_elements());
    }
    absl::Status status = absl::InternalError("gRPC still holds part of the pushed gradient");
    status.SetPayload(worker::kGradientStillHeldPayload, absl::Cord("1"));
    return status;
  }
  absl::StatusOr<worker::PullResult> PushPull(absl::Span<const float* const> grads,
                                              const worker::PushInfo& info,
                                              absl::Span<float* const> values) override {
    if (hold_at_ != 0) return absl::UnimplementedError("not in this test");
    Record(grads);
    return inner_->PushPull(grads, info, values);
  }
  int pushes() const { return pushes_; }
  using worker::PsClient::GetStatus;
  absl::StatusOr<std::vector<StatusResponse>> GetStatus(absl::Time deadline) override {
    return inner_->GetStatus(deadline);
  }
  std::vector<const float*> held;
  std::vector<std::vector<float>> held_values;  // what `held` pointed to when pushed
  std::vector<std::vector<float>> first_values;  // the first push's gradient
  std::vector<std::vector<float>> last_values;   // the last push's

 private:
  void Record(absl::Span<const float* const> grads) {
    last_values.clear();
    for (size_t v = 0; v < grads.size(); ++v) {
      last_values.emplace_back(grads[v], grads[v] + plan().variables()[v].num_elements());
    }
    if (++pushes_ == 1) first_values = last_values;
  }
  std::unique_ptr<worker::PsClient> inner_;
  const int hold_at_;
  int pushes_ = 0;
};

// What was written to the temporary file `file`, which is closed.
std::string ReadAndClose(FILE* file) {
  std::rewind(file);
  std::string said;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, file)) > 0;) said.append(buffer, n);
  std::fclose(file);
  return said;
}

// A small model on generated data, ready to train against shards of the
// test's own.
class TrainerStartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = worker::ParseModel("flatten,dense:10", {8, 8, 1});
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    auto backend = worker::CreateBackend("cpu", {});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    ASSERT_TRUE(backend_->Prepare(model_, 32).ok());
  }

  // The address of a port that nothing listens on: a shard started there
  // and stopped.
  static std::string FreeAddress() {
    server::PsServerOptions ps;
    ps.address = "127.0.0.1:0";
    auto probe = server::PsServer::Start(ps);
    EXPECT_TRUE(probe.ok()) << probe.status();
    return probe.ok() ? (*probe)->client_address() : "";
  }

  // A shard of the test's own on a free loopback port, and client options
  // that reach it.
  void StartShard() {
    server::PsServerOptions ps;
    ps.address = "127.0.0.1:0";
    auto server = server::PsServer::Start(ps);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    shard_options_.ps_addresses = {server_->client_address()};
  }

  const Dataset train = MakeSquares(400, 1), test = MakeSquares(100, 2);
  worker::ModelDef model_;
  std::unique_ptr<worker::ComputeBackend> backend_;
  std::unique_ptr<server::PsServer> server_;
  worker::GrpcPsClientOptions shard_options_;
};

// The ps shards may start after the chief, as a cluster's pods do: the
// chief waits for them as long as --wait_for_variables_s, saying so, where
// its client alone gives up after its retries (here 2, 10 ms apart; 17 s
// with the worker's defaults).
TEST_F(TrainerStartTest, ChiefWaitsForShardsThatStartAfterIt) {
  const std::string address = FreeAddress();
  ASSERT_FALSE(address.empty());
  server::PsServerOptions ps;
  ps.address = "127.0.0.1:" + address.substr(address.rfind(':') + 1);
  worker::GrpcPsClientOptions client_options;
  client_options.ps_addresses = {address};
  client_options.retry.max_attempts = 2;
  client_options.retry.initial_backoff = absl::Milliseconds(10);
  auto client = worker::CreateGrpcPsClient(model_.variables, client_options);
  ASSERT_TRUE(client.ok()) << client.status();

  // No shard within the wait: an error that names the flag.
  worker::TrainerOptions options = SixSteps();
  options.wait_for_variables = absl::Milliseconds(300);
  auto failed = worker::Train(model_, backend_.get(), client->get(), train, test, options);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDeadlineExceeded) << failed.status();
  EXPECT_THAT(failed.status().message(), ::testing::HasSubstr("(--wait_for_variables_s)"));
  // The client's retries within the wait are not its end.
  EXPECT_THAT(failed.status().message(), ::testing::Not(::testing::HasSubstr("gave up")));

  // The shard comes up 1.5 s after the chief started.
  std::unique_ptr<server::PsServer> server;
  absl::Status started;
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(1500));
    auto s = server::PsServer::Start(ps);
    started = s.status();
    if (s.ok()) server = std::move(*s);
  });
  FILE* progress = std::tmpfile();
  ASSERT_NE(progress, nullptr);
  options.progress = progress;
  options.wait_for_variables = absl::Seconds(60);
  auto summary = worker::Train(model_, backend_.get(), client->get(), train, test, options);
  late.join();
  ASSERT_TRUE(started.ok()) << started;
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->steps, 6);
  // Said as the other workers say theirs, with how long of how long; a
  // line that said its check "gave up after 8 attempts" read as the end.
  const std::string said = ReadAndClose(progress);
  EXPECT_THAT(said,
              ::testing::ContainsRegex("waiting for the ps shards \\(([0-9.]+m?s|0) of 1m\\): "
                                       "ps shard 0 \\("));
  EXPECT_THAT(said, ::testing::Not(::testing::HasSubstr("gave up")));
  // The wait is setup, not training: examples/s leaves it out (it used to
  // count it, and a worker that waited reported a fraction of its speed).
  EXPECT_GE(summary->setup_s, 1.0);
  const double training = summary->wall_seconds - summary->eval_s - summary->setup_s;
  ASSERT_GT(training, 0);
  EXPECT_DOUBLE_EQ(summary->examples_per_sec, summary->examples / training);
}

// With --train_steps, the progress counts the epochs and steps that will
// run, as Keras shows steps_per_epoch: 6 steps draw "6/6" in "Epoch 1/1"
// (they drew 6/13 in "Epoch 1/3"); a cap at an epoch's end starts no
// further epoch.
TEST_F(TrainerStartTest, ProgressCountsTheStepsTheCapLeaves) {
  ASSERT_NO_FATAL_FAILURE(StartShard());
  const worker::GrpcPsClientOptions client_options = shard_options_;
  auto client = worker::CreateGrpcPsClient(model_.variables, client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  const int per_epoch = 13;  // 400 examples in batches of 32, the last one short
  struct Case {
    int train_steps;
    std::vector<std::string> said;  // in this order
    size_t epochs;
  };
  for (const Case& c :
       {Case{6, {"Epoch 1/1\n", "\n6/6 ["}, 1}, Case{per_epoch, {"Epoch 1/1\n", "\n13/13 ["}, 1},
        Case{per_epoch + 2, {"Epoch 1/2\n", "\n13/13 [", "Epoch 2/2\n", "\n2/2 ["}, 2}}) {
    SCOPED_TRACE(c.train_steps);
    worker::TrainerOptions options = SixSteps();
    options.epochs = 3;
    options.train_steps = c.train_steps;
    FILE* progress = std::tmpfile();
    ASSERT_NE(progress, nullptr);
    options.progress = progress;
    auto summary = worker::Train(model_, backend_.get(), client->get(), train, test, options);
    const std::string said = ReadAndClose(progress);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->steps, c.train_steps);
    EXPECT_EQ(summary->epochs.size(), c.epochs);
    size_t at = 0;
    for (const std::string& part : c.said) {
      at = said.find(part, at);
      ASSERT_NE(at, std::string::npos) << "no \"" << part << "\" in order in:\n" << said;
    }
    EXPECT_THAT(said, ::testing::Not(::testing::HasSubstr(absl::StrCat("Epoch ", c.epochs + 1))));
  }
}

// On a terminal, an epoch stopped early (--train_steps) ends with its last
// step's line, although steps that come fast are not all drawn.
TEST(ProgressTest, TerminalEpochEndsWithItsLastStep) {
  FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  worker::Progress progress(out, /*tty=*/true, "");
  progress.StartEpoch(1, 1, 100);
  for (int step = 1; step <= 3; ++step) progress.Update(step, 0.25 * step, 0.5, 32 * step);
  progress.EndEpoch(" - test_accuracy: 0.9000");
  const std::string said = ReadAndClose(out);
  EXPECT_THAT(said, ::testing::HasSubstr("\r3/100 ["));
  EXPECT_THAT(said, ::testing::HasSubstr("loss: 0.7500 - accuracy: 0.5000"));
  EXPECT_THAT(said, ::testing::EndsWith(" - test_accuracy: 0.9000\033[K\n"));
}

// The summary is JSON whatever the run gave: a diverged loss is null (it
// was printf's "-nan"), and strings are escaped.
TEST(SummaryJsonTest, NonFiniteNumbersAreNullAndStringsAreEscaped) {
  worker::TrainSummary summary;
  summary.test_loss = std::nan("");
  summary.train_loss = std::numeric_limits<double>::infinity();
  summary.test_accuracy = 0.5;
  const std::string json =
      worker::SummaryToJson(summary, "\"model\": " + worker::JsonString("@/tmp/a\"b\\c\n"));
  EXPECT_THAT(json, ::testing::HasSubstr("\"test_loss\": null, "));
  EXPECT_THAT(json, ::testing::HasSubstr("\"train_loss\": null, "));
  EXPECT_THAT(json, ::testing::HasSubstr("\"test_accuracy\": 0.5, "));
  EXPECT_THAT(json, ::testing::HasSubstr(R"("model": "@/tmp/a\"b\\c\u000a")"));
  EXPECT_THAT(json, ::testing::Not(::testing::HasSubstr("nan")));
  EXPECT_THAT(json, ::testing::Not(::testing::HasSubstr("inf")));
}

// Counts are written exactly, as integers: a resident size of 345543210
// bytes read 3.45543e+08, which a strict reader cannot take as an integer.
TEST(SummaryJsonTest, CountsAreExactIntegers) {
  worker::TrainSummary summary;
  summary.steps = 1234567;
  summary.examples = 79012288;
  summary.resident_bytes = 345543210;
  summary.peak_resident_bytes = 9876543210;
  worker::EpochSummary epoch;
  epoch.epoch = 3;
  epoch.steps = 1234567;
  epoch.resident_bytes = 345543211;
  summary.epochs.push_back(epoch);
  const std::string json = worker::SummaryToJson(summary, "");
  for (const char* exact :
       {"\"steps\": 1234567, ", "\"examples\": 79012288, ", "\"resident_bytes\": 345543210, ",
        "\"peak_resident_bytes\": 9876543210, ", "\"epoch\": 3, ",
        "\"resident_bytes\": 345543211"}) {
    EXPECT_THAT(json, ::testing::HasSubstr(exact));
  }
  EXPECT_THAT(json, ::testing::Not(::testing::HasSubstr("e+")));
}

// A registration the shard refuses (it holds another model) ends the
// chief with an error that names the call, as the training calls' errors
// do (it came without one).
TEST_F(TrainerStartTest, RefusedRegistrationIsNamed) {
  ASSERT_NO_FATAL_FAILURE(StartShard());
  const worker::GrpcPsClientOptions client_options = shard_options_;
  // Another model's kernel under the same name, registered first.
  const std::vector<VariableSpec> other = {{"dense/kernel", {64, 5}}};
  auto other_client = worker::CreateGrpcPsClient(other, client_options);
  ASSERT_TRUE(other_client.ok()) << other_client.status();
  std::vector<float> zeros(64 * 5, 0.0f);
  const float* other_values[] = {zeros.data()};
  ASSERT_TRUE((*other_client)->Register(other_values).ok());

  auto client = worker::CreateGrpcPsClient(model_.variables, client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  auto failed = worker::Train(model_, backend_.get(), client->get(), train, test, SixSteps());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kFailedPrecondition) << failed.status();
  EXPECT_THAT(std::string(failed.status().message()),
              ::testing::StartsWith("registering the model: ps shard 0 ("));
}

// The chief's wait ends when --wait_for_variables_s says, with the
// client's own retries and deadlines (17 s and 60 s with the worker's
// defaults, used here): against a port where nothing listens, and against
// a shard that accepts connections but never answers (one stopped with
// SIGSTOP, here a socket that listens but never accepts).
TEST_F(TrainerStartTest, ChiefStopsWaitingWhenItsWaitIsOver) {
  const std::string refusing = FreeAddress();
  ASSERT_FALSE(refusing.empty());
  // A listening socket that never accepts: the kernel completes the
  // connections, and nothing ever answers on them.
  const int silent_fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent_fd, 0);
  absl::Cleanup close_silent = [silent_fd] { ::close(silent_fd); };
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(silent_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(silent_fd, 16), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(silent_fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string silent = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));

  for (const std::string& address : {refusing, silent}) {
    SCOPED_TRACE(address == silent ? "a shard that never answers" : "no shard listening");
    worker::GrpcPsClientOptions client_options;  // the worker's retries and deadlines
    client_options.ps_addresses = {address};
    auto client = worker::CreateGrpcPsClient(model_.variables, client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    worker::TrainerOptions options = SixSteps();
    options.wait_for_variables = absl::Seconds(1);
    const absl::Time start = absl::Now();
    auto failed = worker::Train(model_, backend_.get(), client->get(), train, test, options);
    const absl::Duration waited = absl::Now() - start;
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kDeadlineExceeded) << failed.status();
    EXPECT_THAT(failed.status().message(), ::testing::HasSubstr("(--wait_for_variables_s)"));
    // The client's retries within the wait are not its end.
    EXPECT_THAT(failed.status().message(), ::testing::Not(::testing::HasSubstr("gave up")));
    // A second of wait, and at most one more check of at least a second.
    EXPECT_LT(waited, absl::Seconds(5)) << "the chief waited " << waited << " for a 1 s wait";
  }
}

// The trainer keeps such a gradient, and leaves it as it was: after Train
// returned it still holds what was pushed (and reading it is no use after
// free, which AddressSanitizer, in CI's second pass, would report).
TEST(TrainerGradientTest, AGradientGrpcStillHoldsIsNeverFreed) {
  const Dataset train = MakeSquares(400, 1), test = MakeSquares(100, 2);
  auto model = worker::ParseModel("flatten,dense:16:relu,dense:10", {8, 8, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  auto shard = StartOneShard(*model);
  ASSERT_TRUE(shard.ok()) << shard.status();
  StillHeldClient client(std::move(shard->client));
  worker::TrainerOptions options = SixSteps();
  options.fused_push_pull = false;
  auto summary = worker::Train(*model, shard->backend.get(), &client, train, test, options);
  EXPECT_EQ(summary.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(worker::GradientStillHeld(summary.status())) << summary.status();
  // The error names the call and the step (the third push).
  EXPECT_THAT(summary.status().message(),
              ::testing::HasSubstr("the push of step 3 (epoch 1, batch 3): gRPC still holds"));
  ASSERT_EQ(client.held.size(), model->variables.size());
  ASSERT_EQ(client.held_values.size(), model->variables.size());
  bool any_nonzero = false;
  for (size_t v = 0; v < client.held.size(); ++v) {
    const std::vector<float>& pushed = client.held_values[v];
    ASSERT_EQ(static_cast<int64_t>(pushed.size()), model->variables[v].num_elements());
    EXPECT_EQ(std::memcmp(client.held[v], pushed.data(), pushed.size() * sizeof(float)), 0)
        << model->variables[v].name << "'s gradient changed after it was pushed";
    for (float g : pushed) any_nonzero |= g != 0.0f;
  }
  EXPECT_TRUE(any_nonzero) << "the pushed gradient was all zeros";
}

// Keras's clipping options reach the pushed gradient: the first push of a
// run with clipvalue holds the gradient of the same run without it (same
// initial values, same batch), clipped element by element; later pushes
// stay within the clip too. Over Push, and over the fused PushPull.
class TrainerClipTest : public ::testing::TestWithParam<bool> {};

TEST_P(TrainerClipTest, PushedGradientIsClippedAsAsked) {
  const Dataset train = MakeSquares(400, 1), test = MakeSquares(100, 2);
  auto model = worker::ParseModel("flatten,dense:16:relu,dense:10", {8, 8, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  constexpr float kClip = 0.01f;
  std::vector<std::vector<float>> first[2];
  for (int clipped : {0, 1}) {
    auto shard = StartOneShard(*model);  // a fresh shard: the same initial values
    ASSERT_TRUE(shard.ok()) << shard.status();
    StillHeldClient client(std::move(shard->client), /*hold_at=*/0);
    worker::TrainerOptions options = SixSteps();
    options.train_steps = 3;
    options.fused_push_pull = GetParam();
    options.clip.clipvalue = clipped ? kClip : 0;
    auto summary = worker::Train(*model, shard->backend.get(), &client, train, test, options);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->clip_s > 0, clipped == 1);
    EXPECT_EQ(client.pushes(), 3);
    first[clipped] = client.first_values;
    if (clipped) {
      for (const auto& v : client.last_values) {
        for (float g : v) ASSERT_LE(std::abs(g), kClip);
      }
    }
  }
  ASSERT_EQ(first[0].size(), first[1].size());
  int beyond = 0;
  for (size_t v = 0; v < first[0].size(); ++v) {
    ASSERT_EQ(first[0][v].size(), first[1][v].size());
    for (size_t i = 0; i < first[0][v].size(); ++i) {
      const float g = first[0][v][i];
      beyond += std::abs(g) > kClip;
      ASSERT_EQ(first[1][v][i], std::clamp(g, -kClip, kClip))
          << model->variables[v].name << "[" << i << "]";
    }
  }
  EXPECT_GT(beyond, 0) << "no element was beyond the clip: the test would show nothing";
}

INSTANTIATE_TEST_SUITE_P(PushAndPushPull, TrainerClipTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Fused" : "Separate";
                         });

// Data that cannot be trained on or evaluated is refused by every worker
// alike before the chief registers anything: with more workers than
// examples the chief's shard was empty and it alone failed, after
// registering, while the others waited for it; a test split of another
// shape was read past the end of the evaluation buffer.
TEST(TrainerInputTest, UnusableDataIsRefusedBeforeAnythingIsRegistered) {
  auto model = worker::ParseModel("flatten,dense:10", {8, 8, 1});
  ASSERT_TRUE(model.ok()) << model.status();
  auto shard = StartOneShard(*model);
  ASSERT_TRUE(shard.ok()) << shard.status();

  Dataset other_shape = MakeSquares(10, 2);
  other_shape.name = "squares/test";
  other_shape.height = other_shape.width = 4;
  other_shape.pixels.resize(10 * 16);
  Dataset empty = MakeSquares(0, 2);
  empty.name = "squares/test";
  Dataset more_classes = MakeSquares(40, 1);
  more_classes.num_classes = 12;
  struct Case {
    const char* what;
    Dataset train, test;
    int replicas;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"3 workers, 2 examples", MakeSquares(2, 1), MakeSquares(10, 2), 3,
       "squares has 2 examples, fewer than the 3 workers"},
      {"test of another shape", MakeSquares(40, 1), other_shape, 1,
       "squares/test has 4x4x1 examples but the model expects 8x8x1"},
      {"empty test", MakeSquares(40, 1), empty, 1, "squares/test has no examples"},
      {"more classes than logits", more_classes, MakeSquares(10, 2), 1,
       "the model's last layer (--model) has 10 units but squares has 12 classes; expected a "
       "last layer dense:12 or wider"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    worker::TrainerOptions options;
    options.num_replicas = c.replicas;
    options.replica_index = 0;
    options.is_chief = true;
    options.batch_size = 32;
    options.epochs = 1;
    options.progress = nullptr;
    auto summary =
        worker::Train(*model, shard->backend.get(), shard->client.get(), c.train, c.test, options);
    ASSERT_FALSE(summary.ok());
    EXPECT_EQ(summary.status().code(), absl::StatusCode::kInvalidArgument) << summary.status();
    EXPECT_THAT(std::string(summary.status().message()), ::testing::HasSubstr(c.want));
    EXPECT_EQ(shard->server->store().stats().parameter_bytes, 0) << "something was registered";
  }
}

INSTANTIATE_TEST_SUITE_P(PushAndPull, TrainingClusterTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Fused" : "Separate";
                         });

}  // namespace
}  // namespace psflow
