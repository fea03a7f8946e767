// The shard's zero-copy decoder (common/grpc_wire.h) against protobuf's own
// parser: what grpc_wire_test's mutated messages and the coverage-guided
// fuzzer (tests/fuzz/) check on every input.
#ifndef PSFLOW_TESTS_COMMON_WIRE_COMPARE_H_
#define PSFLOW_TESTS_COMMON_WIRE_COMPARE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/grpc_wire.h"
#include "google/protobuf/message.h"
#include "tests/common/proto_bytes_variant.h"

namespace psflow::wire::test_support {

// The bytes of segment `s`, copied out of the message's data runs.
inline std::string SegmentData(const DecodedMessage& m, const DecodedSegment& s) {
  std::string out(s.data_bytes, '\0');
  m.CopyData(s, out.data());
  return out;
}

// Every run of decoded data lies inside one of the pieces.
inline bool RunsInsidePieces(const DecodedMessage& m, absl::Span<const absl::string_view> pieces) {
  for (size_t i = 0; i < m.num_segments; ++i) {
    const DecodedSegment& s = m.segments[i];
    int64_t total = 0;
    for (size_t r = s.first_run; r < s.first_run + s.num_runs; ++r) {
      if (r >= m.data_runs.size()) return false;
      const absl::string_view run = m.data_runs[r];
      bool inside = false;
      for (absl::string_view p : pieces) {
        inside =
            inside || (run.data() >= p.data() && run.data() + run.size() <= p.data() + p.size());
      }
      if (!inside) return false;
      total += static_cast<int64_t>(run.size());
    }
    if (total != s.data_bytes) return false;
  }
  return true;
}

// protobuf's own parser, with Segment.variable read as bytes (see
// tests/common/proto_bytes_variant.h).
inline std::unique_ptr<google::protobuf::Message> NewBytesVariant(MessageKind kind) {
  return psflow::test_support::NewBytesVariant(
      kind == MessageKind::kPushRequest ? "psflow.PushRequest" : "psflow.PullResponse");
}

// Field `name` of `m`, read through reflection.
inline const google::protobuf::FieldDescriptor* Field(const google::protobuf::Message& m,
                                                      const char* name) {
  return m.GetDescriptor()->FindFieldByName(name);
}

// Compares what this decoder made of `bytes` with what protobuf's parser
// makes of them; empty when they agree, else what differs.
inline std::string CompareWithProtobuf(MessageKind kind, const std::string& bytes,
                                       absl::Span<const absl::string_view> pieces) {
  DecodedMessage ours;
  const absl::Status status = Decode(kind, pieces, &ours);
  std::unique_ptr<google::protobuf::Message> theirs = NewBytesVariant(kind);
  const bool protobuf_ok = theirs->ParseFromString(bytes);
  if (!status.ok()) {
    if (status.code() != absl::StatusCode::kInvalidArgument) {
      return absl::StrCat("error of the wrong code: ", status.ToString());
    }
    // The one deliberate difference: protobuf keeps a known field of the
    // wrong wire type as an unknown field, this decoder refuses it.
    if (protobuf_ok && status.message().find("has wire type") == absl::string_view::npos) {
      return absl::StrCat("protobuf parses it but the decoder says: ", status.ToString());
    }
    return "";
  }
  if (!RunsInsidePieces(ours, pieces)) return "a data run lies outside the pieces";
  if (!protobuf_ok) return "the decoder accepts what protobuf refuses";
  const google::protobuf::Reflection& r = *theirs->GetReflection();
  const google::protobuf::FieldDescriptor* segments = Field(*theirs, "segments");
  if (static_cast<int>(ours.num_segments) != r.FieldSize(*theirs, segments)) {
    return absl::StrCat(ours.num_segments, " segments, protobuf ", r.FieldSize(*theirs, segments));
  }
  for (size_t i = 0; i < ours.num_segments; ++i) {
    const DecodedSegment& s = ours.segments[i];
    const google::protobuf::Message& t =
        r.GetRepeatedMessage(*theirs, segments, static_cast<int>(i));
    const google::protobuf::Reflection& tr = *t.GetReflection();
    const std::string variable = tr.GetString(t, Field(t, "variable"));
    const int64_t offset = tr.GetInt64(t, Field(t, "offset"));
    const std::string data = tr.GetString(t, Field(t, "data"));
    if (s.variable != variable || s.offset != offset || SegmentData(ours, s) != data) {
      return absl::StrCat("segment ", i, " differs: '", absl::CHexEscape(s.variable), "' at ",
                          s.offset, " with ", s.data_bytes, " bytes; protobuf: '",
                          absl::CHexEscape(variable), "' at ", offset, " with ", data.size());
    }
  }
  if (kind == MessageKind::kPushRequest) {
    const google::protobuf::FieldDescriptor* header = Field(*theirs, "header");
    const google::protobuf::Message& h = r.GetMessage(*theirs, header);
    const google::protobuf::Reflection& hr = *h.GetReflection();
    if (ours.has_header != r.HasField(*theirs, header) ||
        ours.header.worker_id != hr.GetInt32(h, Field(h, "worker_id")) ||
        ours.header.step != hr.GetInt64(h, Field(h, "step")) ||
        ours.header.read_version != hr.GetInt64(h, Field(h, "read_version")) ||
        ours.header.request_id != hr.GetUInt64(h, Field(h, "request_id")) ||
        ours.header.gradient_checked != hr.GetBool(h, Field(h, "gradient_checked")) ||
        ours.header.shard_incarnation != hr.GetUInt64(h, Field(h, "shard_incarnation"))) {
      return "the header differs";
    }
  } else {
    const google::protobuf::FieldDescriptor* versions = Field(*theirs, "versions");
    std::vector<int64_t> expected;
    for (int i = 0; i < r.FieldSize(*theirs, versions); ++i) {
      expected.push_back(r.GetRepeatedInt64(*theirs, versions, i));
    }
    if (ours.versions != expected) return "the versions differ";
  }
  return "";
}

// The same for a PullRequest read by PullRequestView (a single piece: the
// shard joins a request's slices), against protobuf's parser as generated
// (names must be UTF-8).
inline std::string ComparePullRequestWithProtobuf(const std::string& bytes) {
  PullRequestView ours;
  const absl::Status status = ours.Parse(bytes);
  std::unique_ptr<google::protobuf::Message> theirs = std::make_unique<PullRequest>();
  const bool protobuf_ok = theirs->ParseFromString(bytes);
  if (!status.ok()) {
    if (status.code() != absl::StatusCode::kInvalidArgument) {
      return absl::StrCat("error of the wrong code: ", status.ToString());
    }
    if (protobuf_ok && status.message().find("has wire type") == absl::string_view::npos) {
      return absl::StrCat("protobuf parses it but the reader says: ", status.ToString());
    }
    return "";
  }
  if (!protobuf_ok) return "the reader accepts what protobuf refuses";
  const google::protobuf::Reflection& r = *theirs->GetReflection();
  if (ours.worker_id() != r.GetInt32(*theirs, Field(*theirs, "worker_id")) ||
      ours.max_chunk_bytes() != r.GetInt64(*theirs, Field(*theirs, "max_chunk_bytes")) ||
      ours.shard_incarnation() != r.GetUInt64(*theirs, Field(*theirs, "shard_incarnation"))) {
    return "worker_id, max_chunk_bytes or shard_incarnation differs";
  }
  const google::protobuf::FieldDescriptor* ranges = Field(*theirs, "ranges");
  const google::protobuf::FieldDescriptor* variables = Field(*theirs, "variables");
  if (static_cast<int>(ours.num_ranges()) != r.FieldSize(*theirs, ranges) ||
      static_cast<int>(ours.num_variables()) != r.FieldSize(*theirs, variables)) {
    return absl::StrCat(ours.num_ranges(), " ranges and ", ours.num_variables(),
                        " variables; protobuf ", r.FieldSize(*theirs, ranges), " and ",
                        r.FieldSize(*theirs, variables));
  }
  PullRequestView::Walker walk = ours.Walk();
  for (int i = 0; i < r.FieldSize(*theirs, ranges); ++i) {
    PullRangeFields range;
    if (!walk.NextRange(&range)) return absl::StrCat("the walk ended at range ", i);
    const google::protobuf::Message& t = r.GetRepeatedMessage(*theirs, ranges, i);
    const google::protobuf::Reflection& tr = *t.GetReflection();
    if (range.variable != tr.GetString(t, Field(t, "variable")) ||
        range.offset != tr.GetInt64(t, Field(t, "offset")) ||
        range.count != tr.GetInt64(t, Field(t, "count"))) {
      return absl::StrCat("range ", i, " differs");
    }
  }
  PullRangeFields extra;
  if (walk.NextRange(&extra)) return "the walk found a range too many";
  walk = ours.Walk();
  for (int i = 0; i < r.FieldSize(*theirs, variables); ++i) {
    absl::string_view name;
    if (!walk.NextVariable(&name)) return absl::StrCat("the walk ended at variable ", i);
    if (name != r.GetRepeatedString(*theirs, variables, i)) {
      return absl::StrCat("variable ", i, " differs");
    }
  }
  absl::string_view name;
  if (walk.NextVariable(&name)) return "the walk found a variable too many";
  return "";
}

}  // namespace psflow::wire::test_support

#endif  // PSFLOW_TESTS_COMMON_WIRE_COMPARE_H_
