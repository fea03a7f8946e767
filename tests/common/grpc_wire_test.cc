// The hand-written codec against the generated protobuf classes (both
// directions), and its handling of malformed input.
#include "common/grpc_wire.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "psflow.pb.h"

namespace psflow::wire {
namespace {

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

std::string Data(const DecodedMessage& m, const DecodedSegment& s) {
  std::string out(s.data_bytes, '\0');
  m.CopyData(s, out.data());
  return out;
}

TEST(GrpcWireTest, EncodedPushRequestParsesWithProtobuf) {
  const std::string d1 = Floats(300, 1.5f), d2 = Floats(3, -7.0f);
  std::string bytes;
  AppendPushHeader(&bytes, {-3, 42, 7, 0xfedcba9876543210ull});
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
    ASSERT_EQ(out.num_segments, 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(out.segments[i].variable, msg.segments(i).variable());
      EXPECT_EQ(out.segments[i].offset, msg.segments(i).offset());
      EXPECT_EQ(Data(out, out.segments[i]), msg.segments(i).data());
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
  EXPECT_EQ(Data(out, out.segments[0]), Floats(1, 3.0f));
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
      {"huge length", std::string("\x12\xff\xff\xff\xff\x0f", 6), "claims"},
      {"truncated fixed64", std::string("\x0a\x02\x21\x00", 4), "needs 8 bytes"},
      {"segments with varint type", std::string("\x10\x01", 2), "wire type 0", false},
      {"header with fixed32 type", std::string("\x0d\x00\x00\x00\x00", 5), "wire type 5", false},
      {"data with varint type", std::string("\x12\x02\x18\x01", 4), "field data", false},
      {"request_id as varint", std::string("\x0a\x02\x20\x01", 4), "request_id", false},
      {"invalid wire type 7", std::string("\x0f", 1), "invalid wire type"},
      {"field number 0", std::string("\x02\x00", 2), "invalid field number"},
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

}  // namespace
}  // namespace psflow::wire
