// Coverage-guided fuzzing (libFuzzer) of the shard's zero-copy decoder of
// push requests and pull responses, and of its in-place reader of pull
// requests: every input, cut into the pieces that
// gRPC's slices would give, must decode as protobuf's own parser reads it,
// or be refused with INVALID_ARGUMENT, and (under ASan and UBSan) touch no
// byte outside the pieces. Built and run by tests/fuzz/run.sh (clang); see
// docs/ARCHITECTURE.md, "Testing".
//
// Input layout (FuzzedDataProvider takes integers from the end): the last
// byte picks the message kind, the one before it the number of cuts (0-6),
// then 2 bytes per cut position; the rest, from the start, is the message.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "tests/common/wire_compare.h"

// protobuf logs each name that is not UTF-8 it refuses: most inputs here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using psflow::wire::MessageKind;
  FuzzedDataProvider input(data, size);
  const MessageKind kind =
      input.ConsumeBool() ? MessageKind::kPushRequest : MessageKind::kPullResponse;
  std::vector<uint16_t> cuts(input.ConsumeIntegralInRange<int>(0, 6));
  for (uint16_t& cut : cuts) cut = input.ConsumeIntegral<uint16_t>();
  const std::string bytes = input.ConsumeRemainingBytesAsString();
  std::vector<size_t> at;
  for (uint16_t cut : cuts) at.push_back(cut % (bytes.size() + 1));
  std::sort(at.begin(), at.end());
  std::vector<absl::string_view> pieces;
  size_t begin = 0;
  for (size_t end : at) {
    pieces.push_back(absl::string_view(bytes).substr(begin, end - begin));
    begin = end;
  }
  pieces.push_back(absl::string_view(bytes).substr(begin));
  const std::string diff = psflow::wire::test_support::CompareWithProtobuf(kind, bytes, pieces);
  if (!diff.empty()) {
    std::fprintf(stderr, "decoder and protobuf differ: %s\n", diff.c_str());
    std::abort();
  }
  // The same bytes as a PullRequest, read in place (one piece, as the
  // shard joins a request's slices).
  const std::string pull = psflow::wire::test_support::ComparePullRequestWithProtobuf(bytes);
  if (!pull.empty()) {
    std::fprintf(stderr, "PullRequestView and protobuf differ: %s\n", pull.c_str());
    std::abort();
  }
  return 0;
}
