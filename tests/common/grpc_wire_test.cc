// The hand-written codec against the generated protobuf classes (both
// directions), and its handling of malformed input.
#include "common/grpc_wire.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "gtest/gtest.h"
#include "psflow.pb.h"
#include "tests/common/proto_bytes_variant.h"
#include "tests/common/wire_compare.h"

namespace psflow::wire {
namespace {

using test_support::ComparePullRequestWithProtobuf;
using test_support::CompareWithProtobuf;
using test_support::SegmentData;

std::string Floats(int n, float base) {
  std::string out(n * 4, '\0');
  for (int i = 0; i < n; ++i) {
    const float v = base + i;
    std::memcpy(&out[i * 4], &v, 4);
  }
  return out;
}

// Splits `bytes` into pieces of `size` bytes (the last one shorter).
std::vector<absl::string_view> Split(const std::string& bytes, size_t size) {
  std::vector<absl::string_view> out;
  for (size_t i = 0; i < bytes.size(); i += size) {
    out.push_back(absl::string_view(bytes).substr(i, size));
  }
  return out;
}


TEST(GrpcWireTest, EncodedPushRequestParsesWithProtobuf) {
  const std::string d1 = Floats(300, 1.5f), d2 = Floats(3, -7.0f);
  std::string bytes;
  AppendPushHeader(&bytes, {-3, 42, 7, 0xfedcba9876543210ull, /*gradient_checked=*/true,
                            /*shard_incarnation=*/0x0123456789abcdefull});
  AppendSegmentPrefix(&bytes, 2, "dense/kernel", 1000, d1.size());
  bytes += d1;
  AppendSegmentPrefix(&bytes, 2, "b", 0, d2.size());
  bytes += d2;
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  EXPECT_EQ(parsed.header().worker_id(), -3);
  EXPECT_EQ(parsed.header().step(), 42);
  EXPECT_EQ(parsed.header().read_version(), 7);
  EXPECT_EQ(parsed.header().request_id(), 0xfedcba9876543210ull);
  EXPECT_TRUE(parsed.header().gradient_checked());
  EXPECT_EQ(parsed.header().shard_incarnation(), 0x0123456789abcdefull);
  ASSERT_EQ(parsed.segments_size(), 2);
  EXPECT_EQ(parsed.segments(0).variable(), "dense/kernel");
  EXPECT_EQ(parsed.segments(0).offset(), 1000);
  EXPECT_EQ(parsed.segments(0).data(), d1);
  EXPECT_EQ(parsed.segments(1).variable(), "b");
  EXPECT_EQ(parsed.segments(1).offset(), 0);
  EXPECT_EQ(parsed.segments(1).data(), d2);
}

TEST(GrpcWireTest, EncodedPullResponseParsesWithProtobuf) {
  const std::string d = Floats(5, 2.0f);
  std::string bytes;
  AppendSegmentPrefix(&bytes, 1, "v", 123456789012ll, d.size());
  bytes += d;
  AppendSegmentPrefix(&bytes, 1, "w", 1, 0);
  const std::vector<int64_t> versions = {300, 0};
  AppendPackedInt64(&bytes, 2, versions);
  PullResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  ASSERT_EQ(parsed.segments_size(), 2);
  EXPECT_EQ(parsed.segments(0).offset(), 123456789012ll);
  EXPECT_EQ(parsed.segments(0).data(), d);
  EXPECT_EQ(parsed.segments(1).variable(), "w");
  EXPECT_TRUE(parsed.segments(1).data().empty());
  ASSERT_EQ(parsed.versions_size(), 2);
  EXPECT_EQ(parsed.versions(0), 300);
  EXPECT_EQ(parsed.versions(1), 0);
}

TEST(GrpcWireTest, DecodesProtobufPushSplitIntoTinyPieces) {
  PushRequest msg;
  msg.mutable_header()->set_worker_id(5);
  msg.mutable_header()->set_step(-1);
  msg.mutable_header()->set_request_id(99);
  msg.mutable_header()->set_gradient_checked(true);
  msg.mutable_header()->set_shard_incarnation(0xfeedfacecafebeefull);
  for (int i = 0; i < 3; ++i) {
    Segment* s = msg.add_segments();
    s->set_variable("var" + std::to_string(i));
    s->set_offset(i * 10);
    s->set_data(Floats(10 + i * 100, i));
  }
  const std::string bytes = msg.SerializeAsString();
  for (size_t piece : {1, 3, 7, 4096, 100000}) {
    DecodedMessage out;
    ASSERT_TRUE(Decode(MessageKind::kPushRequest, Split(bytes, piece), &out).ok()) << piece;
    EXPECT_TRUE(out.has_header);
    EXPECT_EQ(out.header.worker_id, 5);
    EXPECT_EQ(out.header.step, -1);
    EXPECT_EQ(out.header.request_id, 99u);
    EXPECT_TRUE(out.header.gradient_checked);
    EXPECT_EQ(out.header.shard_incarnation, 0xfeedfacecafebeefull);
    ASSERT_EQ(out.num_segments, 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(out.segments[i].variable, msg.segments(i).variable());
      EXPECT_EQ(out.segments[i].offset, msg.segments(i).offset());
      EXPECT_EQ(SegmentData(out, out.segments[i]), msg.segments(i).data());
    }
  }
}

TEST(GrpcWireTest, DecodesPackedAndUnpackedVersions) {
  PullResponse msg;
  msg.add_segments()->set_variable("a");
  msg.add_versions(1);
  msg.add_versions(1ll << 40);
  std::string bytes = msg.SerializeAsString();  // packed
  // An unpacked occurrence appended: field 2, varint 9.
  bytes += std::string("\x10\x09", 2);
  DecodedMessage out;
  ASSERT_TRUE(Decode(MessageKind::kPullResponse, Split(bytes, 2), &out).ok());
  ASSERT_EQ(out.versions.size(), 3u);
  EXPECT_EQ(out.versions[0], 1);
  EXPECT_EQ(out.versions[1], 1ll << 40);
  EXPECT_EQ(out.versions[2], 9);
}

TEST(GrpcWireTest, SkipsUnknownFieldsOfEveryWireType) {
  std::string bytes;
  bytes += std::string("\x28\x96\x01", 3);                 // field 5 varint 150
  bytes += std::string("\x31") + std::string(8, 'x');      // field 6 fixed64
  bytes += std::string("\x3a\x03" "abc", 5);               // field 7 len 3
  bytes += std::string("\x45") + std::string(4, 'y');      // field 8 fixed32
  bytes += std::string("\x4b\x08\x01\x4c", 4);             // group 9 { field 1 = 1 }
  // A segment with an unknown field 9 inside it.
  std::string seg = std::string("\x0a\x01v", 3) + std::string("\x48\x07", 2) +
                    std::string("\x1a\x04", 2) + Floats(1, 3.0f);
  bytes += "\x12";
  bytes += static_cast<char>(seg.size());
  bytes += seg;
  DecodedMessage out;
  ASSERT_TRUE(Decode(MessageKind::kPushRequest, Split(bytes, 1), &out).ok());
  EXPECT_FALSE(out.has_header);
  ASSERT_EQ(out.num_segments, 1u);
  EXPECT_EQ(out.segments[0].variable, "v");
  EXPECT_EQ(SegmentData(out, out.segments[0]), Floats(1, 3.0f));
  // Protobuf agrees.
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  EXPECT_EQ(parsed.segments(0).data(), Floats(1, 3.0f));
}

absl::Status DecodePush(const std::string& bytes) {
  DecodedMessage out;
  return Decode(MessageKind::kPushRequest, Split(bytes, 3), &out);
}

TEST(GrpcWireTest, MalformedInputIsInvalidArgument) {
  struct Case {
    const char* name;
    std::string bytes;
    const char* message_part;
    // Protobuf keeps a known field with the wrong wire type as an unknown
    // field; this decoder refuses it (no conforming encoder writes one).
    bool protobuf_refuses = true;
  };
  const Case cases[] = {
      {"truncated tag", std::string("\x92", 1), "truncated varint"},
      {"truncated varint value", std::string("\x28\xff", 2), "truncated varint"},
      {"varint over 10 bytes", std::string("\x28") + std::string(11, '\xff'), "longer than 10"},
      {"length past the end", std::string("\x12\x05\x0a\x01", 4), "claims 5 bytes"},
      {"inner length past the segment", std::string("\x12\x02\x1a\x09", 4), "claims 9 bytes"},
      {"huge length", std::string("\x12\xff\xff\xff\xff\x0f", 6), "2^31 or more"},
      {"length past the end", std::string("\x12\xff\xff\xff\x07", 5), "claims"},
      {"truncated fixed64", std::string("\x0a\x02\x21\x00", 4), "needs 8 bytes"},
      {"segments with varint type", std::string("\x10\x01", 2), "wire type 0", false},
      {"header with fixed32 type", std::string("\x0d\x00\x00\x00\x00", 5), "wire type 5", false},
      {"data with varint type", std::string("\x12\x02\x18\x01", 4), "field data", false},
      {"request_id as varint", std::string("\x0a\x02\x20\x01", 4), "request_id", false},
      {"gradient_checked as fixed64", std::string("\x0a\x09\x29", 3) + std::string(8, '\x01'),
       "gradient_checked", false},
      {"invalid wire type 7", std::string("\x0f", 1), "invalid wire type"},
      {"field number 0", std::string("\x02\x00", 2), "invalid field number"},
      {"tag over 5 bytes", std::string("\x88\x80\x80\x80\x80\x00", 6), "longer than 5 bytes"},
      {"stray end group", std::string("\x2c", 1), "end of group"},
      {"unterminated group", std::string("\x2b\x08\x01", 3), "unterminated group"},
      {"mismatched group end", std::string("\x2b\x34", 2), "closed by end of group"},
  };
  for (const Case& c : cases) {
    const absl::Status s = DecodePush(c.bytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
    EXPECT_NE(s.message().find(c.message_part), absl::string_view::npos) << c.name << ": " << s;
    if (c.protobuf_refuses) {  // the generated parser agrees the bytes are malformed
      PushRequest parsed;
      EXPECT_FALSE(parsed.ParseFromString(c.bytes)) << c.name;
    }
  }
}

// Empty segments cost the decoder about 64 bytes each and the sender 2: a
// message of more than MaxSegments of them is refused, while one whose
// segments all carry data never reaches the bound.
TEST(GrpcWireTest, FloodsOfEmptySegmentsAreRefused) {
  std::string empty_segments = std::string("\x0a\x00", 2);  // an empty header
  for (int i = 0; i < 200000; ++i) empty_segments += std::string("\x12\x00", 2);
  DecodedMessage out;
  const std::vector<absl::string_view> pieces = {empty_segments};
  const absl::Status s = Decode(MessageKind::kPushRequest, pieces, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  const std::string want =
      "more than " + std::to_string(MaxSegments(400002)) + " segments in its 400002 bytes";
  EXPECT_NE(s.message().find(want), absl::string_view::npos) << s;
  EXPECT_LE(out.segments.size(), MaxSegments(400002));

  // The smallest segments that carry data (one float, no name): 8 bytes.
  std::string smallest = std::string("\x0a\x00", 2);
  const std::string one = std::string("\x12\x06\x1a\x04", 4) + Floats(1, 1.0f);
  for (int i = 0; i < 200000; ++i) smallest += one;
  const std::vector<absl::string_view> data_pieces = {smallest};
  ASSERT_TRUE(Decode(MessageKind::kPushRequest, data_pieces, &out).ok());
  EXPECT_EQ(out.num_segments, 200000u);
}

TEST(GrpcWireTest, DeeplyNestedGroupsAreRefusedNotRecursedForever) {
  std::string bytes;
  for (int i = 0; i < 200; ++i) bytes += "\x2b";  // start group 5, never closed
  EXPECT_EQ(DecodePush(bytes).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GrpcWireTest, EveryTruncationOfAValidMessageIsRefusedOrAPrefix) {
  PushRequest msg;
  msg.mutable_header()->set_step(3);
  Segment* s = msg.add_segments();
  s->set_variable("x");
  s->set_data(Floats(4, 1.0f));
  const std::string bytes = msg.SerializeAsString();
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::string cut = bytes.substr(0, n);
    PushRequest parsed;
    const bool protobuf_ok = parsed.ParseFromString(cut);
    const absl::Status ours = DecodePush(cut);
    EXPECT_EQ(ours.ok(), protobuf_ok) << "cut at " << n << ": " << ours;
  }
}

// ---- Randomized comparison with the generated parser ----

// A valid message of `kind` with random contents, serialized by protobuf.
std::string RandomMessage(MessageKind kind, std::mt19937_64& rng) {
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  auto random_i64 = [&]() -> int64_t {
    switch (pick(4)) {
      case 0: return 0;
      case 1: return static_cast<int64_t>(pick(300));
      case 2: return -static_cast<int64_t>(pick(1000));
      default: return static_cast<int64_t>(rng());
    }
  };
  auto fill = [&](Segment* s) {
    std::string name(pick(12), 'a');
    for (char& ch : name) ch = static_cast<char>('a' + pick(26));
    s->set_variable(name);
    s->set_offset(random_i64());
    std::string data(pick(40), '\0');
    for (char& ch : data) ch = static_cast<char>(rng());
    s->set_data(data);
  };
  if (kind == MessageKind::kPushRequest) {
    PushRequest m;
    if (pick(4) != 0) {
      m.mutable_header()->set_worker_id(static_cast<int32_t>(random_i64()));
      m.mutable_header()->set_step(random_i64());
      m.mutable_header()->set_read_version(random_i64());
      m.mutable_header()->set_request_id(rng());
      m.mutable_header()->set_gradient_checked(pick(2) == 0);
      if (pick(2)) m.mutable_header()->set_shard_incarnation(rng());
    }
    for (uint64_t i = pick(4); i > 0; --i) fill(m.add_segments());
    return m.SerializeAsString();
  }
  PullResponse m;
  for (uint64_t i = pick(4); i > 0; --i) {
    fill(m.add_segments());
    m.add_versions(random_i64());
  }
  return m.SerializeAsString();
}

// Changes `bytes` in one of the ways a broken or hostile peer might.
void Mutate(std::string* bytes, std::mt19937_64& rng) {
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  // Bytes that mean something to the format: continuation bits, the tags
  // of known fields with every wire type, group starts and ends, lengths.
  static const char kInteresting[] = {'\x80', '\xff', '\x7f', '\x00', '\x01', '\x08', '\x09',
                                      '\x0a', '\x0b', '\x0c', '\x10', '\x11', '\x12', '\x13',
                                      '\x14', '\x15', '\x18', '\x1a', '\x21', '\x2b', '\x2c'};
  auto random_byte = [&] {
    return pick(2) == 0 ? kInteresting[pick(sizeof(kInteresting))] : static_cast<char>(rng());
  };
  const size_t n = bytes->size();
  switch (pick(7)) {
    case 0:  // flip a bit
      if (n > 0) (*bytes)[pick(n)] ^= static_cast<char>(1 << pick(8));
      break;
    case 1:  // overwrite a byte
      if (n > 0) (*bytes)[pick(n)] = random_byte();
      break;
    case 2: {  // insert bytes
      std::string ins(1 + pick(3), '\0');
      for (char& ch : ins) ch = random_byte();
      bytes->insert(pick(n + 1), ins);
      break;
    }
    case 3:  // delete a range
      if (n > 0) {
        const size_t at = pick(n);
        bytes->erase(at, 1 + pick(std::min<size_t>(n - at, 8)));
      }
      break;
    case 4:  // truncate
      bytes->resize(pick(n + 1));
      break;
    case 5: {  // insert a run of continuation bytes: long varints and tags
      std::string ins(1 + pick(12), '\0');
      for (char& ch : ins) ch = static_cast<char>(0x80 | pick(2) * rng());
      bytes->insert(pick(n + 1), ins);
      break;
    }
    default:  // repeat a range
      if (n > 0) {
        const size_t at = pick(n);
        const std::string copy = bytes->substr(at, 1 + pick(std::min<size_t>(n - at, 16)));
        bytes->insert(pick(n + 1), copy);
      }
      break;
  }
}

// Splits `bytes` at random points, empty pieces included, as gRPC's slices
// might.
std::vector<absl::string_view> RandomPieces(const std::string& bytes, std::mt19937_64& rng) {
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  std::vector<absl::string_view> out;
  const absl::string_view all(bytes);
  const size_t max_piece = pick(2) == 0 ? 1 + pick(4) : 1 + pick(bytes.size() + 1);
  for (size_t at = 0; at < bytes.size();) {
    const size_t len = pick(max_piece + 1);  // 0: an empty piece
    out.push_back(all.substr(at, len));
    at += std::min(len, bytes.size() - at);
  }
  if (pick(8) == 0) out.push_back(absl::string_view());
  return out;
}


void FuzzAgainstProtobuf(MessageKind kind, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int refused = 0;
  constexpr int kCases = 20000;
  for (int i = 0; i < kCases; ++i) {
    std::string bytes = RandomMessage(kind, rng);
    for (uint64_t m = 1 + rng() % 3; m > 0; --m) Mutate(&bytes, rng);
    const std::vector<absl::string_view> pieces = RandomPieces(bytes, rng);
    const std::string diff = CompareWithProtobuf(kind, bytes, pieces);
    ASSERT_EQ(diff, "") << "case " << i << " of seed " << seed << ", " << pieces.size()
                        << " pieces: \"" << absl::CHexEscape(bytes) << "\"";
    DecodedMessage out;
    refused += !Decode(kind, pieces, &out).ok();
  }
  // The mutations must reach both outcomes, or the comparison proves little.
  EXPECT_GT(refused, kCases / 10);
  EXPECT_LT(refused, kCases * 9 / 10);
}

TEST(GrpcWireTest, MutatedPushRequestsDecodeAsProtobufParsesThem) {
  FuzzAgainstProtobuf(MessageKind::kPushRequest, 1);
}

TEST(GrpcWireTest, MutatedPullResponsesDecodeAsProtobufParsesThem) {
  FuzzAgainstProtobuf(MessageKind::kPullResponse, 2);
}

// A valid PullRequest with random contents, serialized by protobuf.
std::string RandomPullRequest(std::mt19937_64& rng) {
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  auto name = [&] {
    std::string out(pick(12), 'a');
    for (char& ch : out) ch = static_cast<char>('a' + pick(26));
    return out;
  };
  PullRequest m;
  if (pick(2)) m.set_worker_id(static_cast<int32_t>(rng()));
  if (pick(2)) m.set_max_chunk_bytes(pick(2) ? static_cast<int64_t>(pick(1 << 20)) : rng());
  if (pick(2)) m.set_shard_incarnation(rng());
  for (uint64_t i = pick(4); i > 0; --i) m.add_variables(name());
  for (uint64_t i = pick(4); i > 0; --i) {
    PullRange* r = m.add_ranges();
    r->set_variable(name());
    if (pick(2)) r->set_offset(pick(2) ? static_cast<int64_t>(pick(1000)) : rng());
    if (pick(2)) r->set_count(pick(2) ? static_cast<int64_t>(pick(1000)) : rng());
  }
  return m.SerializeAsString();
}

TEST(GrpcWireTest, MutatedPullRequestsReadAsProtobufParsesThem) {
  // protobuf logs each name that is not UTF-8; here they are many.
  google::protobuf::LogHandler* old_handler = google::protobuf::SetLogHandler(nullptr);
  std::mt19937_64 rng(3);
  int refused = 0;
  constexpr int kCases = 20000;
  for (int i = 0; i < kCases; ++i) {
    std::string bytes = RandomPullRequest(rng);
    const bool mutated = rng() % 8 != 0;  // some stay valid, to check the fields
    if (mutated) {
      for (uint64_t m = 1 + rng() % 3; m > 0; --m) Mutate(&bytes, rng);
    }
    const std::string diff = ComparePullRequestWithProtobuf(bytes);
    ASSERT_EQ(diff, "") << "case " << i << ": \"" << absl::CHexEscape(bytes) << "\"";
    PullRequestView view;
    const bool ok = view.Parse(bytes).ok();
    ASSERT_TRUE(ok || mutated) << "a valid request was refused";
    refused += !ok;
  }
  google::protobuf::SetLogHandler(old_handler);
  EXPECT_GT(refused, kCases / 10);
  EXPECT_LT(refused, kCases * 9 / 10);
}

// Where protobuf's parser draws its lines, the decoders draw them too: names
// that are not UTF-8 in a pull request (also one never looked up), lengths
// padded past 5 bytes, groups nested 100 deep (99 inside a message).
TEST(GrpcWireTest, DecodersRefuseWhatProtobufRefusesAtItsLimits) {
  google::protobuf::LogHandler* old_handler = google::protobuf::SetLogHandler(nullptr);
  // Groups of field 5, or (top level of a pull request, where 5 is known)
  // field 6.
  auto groups = [](int n) { return std::string(n, '\x2b') + std::string(n, '\x2c'); };
  auto groups6 = [](int n) { return std::string(n, '\x33') + std::string(n, '\x34'); };
  auto in_range = [](const std::string& body) {
    std::string out = "\x22";
    AppendVarint(&out, body.size());
    return out + body;
  };
  auto in_segment = [](const std::string& body) {
    std::string out = "\x12";
    AppendVarint(&out, body.size());
    return out + body;
  };
  const std::string range_a =
      in_range(std::string("\x0a\x01"
                           "a\x18\x01",
                           5));
  struct Case {
    const char* what;
    std::string bytes;
    bool valid;  // for protobuf
  };
  const std::vector<Case> pulls = {
      {"a name that is not UTF-8 beside ranges", range_a + "\x12\x01\xff", false},
      {"a range's first name is not UTF-8",
       in_range("\x0a\x01\xff\x0a\x01"
                "a"),
       false},
      {"a UTF-8 name of two bytes", in_range("\x0a\x02\xc3\xa9"), true},
      {"a length padded to 6 bytes", std::string("\x32\x80\x80\x80\x80\x80\x00", 7), false},
      {"a length padded to 5 bytes", std::string("\x32\x80\x80\x80\x80\x00", 6), true},
      {"a length of 2^28", std::string("\x32\x80\x80\x80\x80\x01", 6), false},
      {"100 nested groups", groups6(100), true},
      {"101 nested groups", groups6(101), false},
      {"99 nested groups in a range", in_range(groups(99)), true},
      {"100 nested groups in a range", in_range(groups(100)), false},
  };
  for (const Case& c : pulls) {
    PullRequest parsed;
    ASSERT_EQ(parsed.ParseFromString(c.bytes), c.valid) << c.what << ": the case is wrong";
    PullRequestView view;
    EXPECT_EQ(view.Parse(c.bytes).ok(), c.valid) << c.what;
    EXPECT_EQ(ComparePullRequestWithProtobuf(c.bytes), "") << c.what;
  }
  const std::vector<Case> pushes = {
      {"a length padded to 6 bytes", std::string("\x2a\x80\x80\x80\x80\x80\x00", 7), false},
      {"a length padded to 5 bytes", std::string("\x2a\x80\x80\x80\x80\x00", 6), true},
      {"100 nested groups", groups(100), true},
      {"101 nested groups", groups(101), false},
      {"99 nested groups in a segment", in_segment(groups(99)), true},
      {"100 nested groups in a segment", in_segment(groups(100)), false},
  };
  for (const Case& c : pushes) {
    PushRequest parsed;
    ASSERT_EQ(parsed.ParseFromString(c.bytes), c.valid) << c.what << ": the case is wrong";
    EXPECT_EQ(DecodePush(c.bytes).ok(), c.valid) << c.what;
  }
  google::protobuf::SetLogHandler(old_handler);
}

// A request of many ranges is read one range at a time: the view holds no
// record per range.
TEST(GrpcWireTest, PullRequestViewWalksRangesInPlace) {
  PullRequest m;
  m.set_max_chunk_bytes(1 << 20);
  for (int i = 0; i < 100000; ++i) {
    PullRange* r = m.add_ranges();
    r->set_variable(i % 2 ? "bias" : "kernel");
    r->set_offset(i);
    r->set_count(i % 7);
  }
  const std::string bytes = m.SerializeAsString();
  PullRequestView view;
  ASSERT_TRUE(view.Parse(bytes).ok());
  EXPECT_EQ(view.num_ranges(), 100000u);
  EXPECT_EQ(view.num_variables(), 0u);
  EXPECT_EQ(view.max_chunk_bytes(), 1 << 20);
  PullRequestView::Walker walk = view.Walk();
  PullRangeFields range;
  int i = 0;
  for (; walk.NextRange(&range); ++i) {
    ASSERT_EQ(range.variable, i % 2 ? "bias" : "kernel");
    ASSERT_EQ(range.offset, i);
    ASSERT_EQ(range.count, i % 7);
    // The name lies in the request's bytes.
    ASSERT_TRUE(range.variable.data() >= bytes.data() &&
                range.variable.data() + range.variable.size() <= bytes.data() + bytes.size());
  }
  EXPECT_EQ(i, 100000);
}

}  // namespace
}  // namespace psflow::wire
