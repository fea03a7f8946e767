// grpc_wire: a hand-written codec for the two hot messages of
// proto/psflow.proto, PushRequest and PullResponse (and a reader of
// PullRequest, below, whose cost it bounds), so that tensor bytes go
// between gRPC's slices and the caller's memory without an intermediate
// protobuf copy. The bytes it writes are exactly protobuf's wire format (a
// client using the generated classes can parse them, and this decoder parses
// what the generated classes write); nothing in the contract changes.
//
// Decoding works on a message held as a list of pieces (the slices of a
// grpc::ByteBuffer, in order) and never copies float data: a segment's data
// is a list of (pointer, length) runs into those pieces. Malformed input
// (truncated varints or fields, lengths past the end, wrong wire types of
// known fields, bad group nesting) is INVALID_ARGUMENT naming what was wrong
// and where; it never reads outside the pieces. Unknown fields are skipped
// as protobuf does. Otherwise it accepts exactly what protobuf's parser
// accepts (lengths of at most 5 bytes, groups and messages nested at most
// 100 deep), with three differences: a known field of the wrong wire type
// is refused (protobuf would keep it as an unknown field); Segment.variable
// is taken as bytes without proto3's UTF-8 check (a name that is not UTF-8
// matches no variable); and a message of more than MaxSegments(its bytes)
// segments is refused. A segment that carries data takes at least 8 bytes
// on the wire, so only segments without data reach that bound, and a 5 MiB
// message of 2.6 million empty 2-byte segments no longer takes 166 MB to
// decode. grpc_wire_test compares the decoder with protobuf on randomly
// broken messages.
#ifndef PSFLOW_COMMON_GRPC_WIRE_H_
#define PSFLOW_COMMON_GRPC_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace grpc {
class ByteBuffer;
class Slice;
}  // namespace grpc

namespace psflow::wire {

// ---- Encoding ----

void AppendVarint(std::string* out, uint64_t value);
// Most bytes WriteSegmentPrefix writes for `variable`.
size_t MaxSegmentPrefixSize(absl::string_view variable);
// Writes, for a Segment that is field `field` of its message, everything
// that precedes its float data: the field tag, the segment's length, its
// variable and offset, and the data field's tag and length. The caller
// places (or hands over as a slice) `data_bytes` bytes of data right after.
// `out` needs MaxSegmentPrefixSize(variable) bytes; returns the bytes written.
size_t WriteSegmentPrefix(char* out, int field, absl::string_view variable, int64_t offset,
                          size_t data_bytes);
// The bytes WriteSegmentPrefix writes for these arguments, exactly.
size_t SegmentPrefixSize(int field, absl::string_view variable, int64_t offset,
                         size_t data_bytes);
// Same, appended to a string.
size_t AppendSegmentPrefix(std::string* out, int field, absl::string_view variable,
                           int64_t offset, size_t data_bytes);

struct PushHeaderFields {
  int32_t worker_id = 0;
  int64_t step = 0;
  int64_t read_version = 0;
  uint64_t request_id = 0;
  bool gradient_checked = false;
  uint64_t shard_incarnation = 0;
};
// PushRequest.header (field 1), appended.
void AppendPushHeader(std::string* out, const PushHeaderFields& header);
// A packed repeated int64 field (PullResponse.versions is field 2), appended;
// nothing for no values.
void AppendPackedInt64(std::string* out, int field, absl::Span<const int64_t> values);

// ---- Decoding ----

struct DecodedSegment {
  std::string variable;
  int64_t offset = 0;
  int64_t data_bytes = 0;
  // The data is data_runs[first_run, first_run + num_runs) of the message.
  size_t first_run = 0;
  size_t num_runs = 0;
};

// One decoded PushRequest or PullResponse. Reuse one object across messages:
// Clear() keeps the allocated capacity. Runs point into the decoded pieces,
// which must outlive their use.
struct DecodedMessage {
  bool has_header = false;
  PushHeaderFields header;               // PushRequest only
  std::vector<DecodedSegment> segments;  // the first num_segments are valid
  size_t num_segments = 0;
  std::vector<absl::string_view> data_runs;
  std::vector<int64_t> versions;  // PullResponse only

  void Clear();
  // Copies segment `s`'s data (s.data_bytes bytes) to `out`.
  void CopyData(const DecodedSegment& s, void* out) const;
};

enum class MessageKind { kPushRequest, kPullResponse };

// The most segments Decode accepts in a message of `message_bytes` bytes:
// 1024, and one per 8 bytes.
size_t MaxSegments(size_t message_bytes);

// Parses one message held in `pieces` (concatenated in order) into `out`.
// On error `out` holds an unspecified part of the message.
absl::Status Decode(MessageKind kind, absl::Span<const absl::string_view> pieces,
                    DecodedMessage* out);

// ---- PullRequest ----

struct PullRangeFields {
  absl::string_view variable;
  int64_t offset = 0;
  int64_t count = 0;
};

// A PullRequest read where its bytes lie. Parse checks the whole message
// once, as protobuf's parser would (names included: one that is not UTF-8
// is refused), but for one difference, as in Decode: a known field of the
// wrong wire type is refused. It keeps the scalar fields; the ranges and
// variable names are then read one at a time from the bytes. So a request
// costs the shard its own bytes while the call lasts, where protobuf's
// objects took about 120 bytes a range (60 MB for a 5 MB request of
// 500,000 ranges). `bytes` must outlive the view and its walkers.
class PullRequestView {
 public:
  absl::Status Parse(absl::string_view bytes);
  int32_t worker_id() const { return worker_id_; }
  int64_t max_chunk_bytes() const { return max_chunk_bytes_; }
  uint64_t shard_incarnation() const { return shard_incarnation_; }
  size_t num_ranges() const { return num_ranges_; }
  size_t num_variables() const { return num_variables_; }

  // Reads the entries of one repeated field, in order, from the start.
  class Walker {
   public:
    // The next PullRequest.ranges entry; false after the last.
    bool NextRange(PullRangeFields* out);
    // The next PullRequest.variables entry; false after the last.
    bool NextVariable(absl::string_view* out);

   private:
    friend class PullRequestView;
    explicit Walker(absl::string_view bytes) : bytes_(bytes) {}
    bool NextEntry(uint32_t field, absl::string_view* body);
    absl::string_view bytes_;
    uint64_t pos_ = 0;
  };
  Walker Walk() const { return Walker(bytes_); }

 private:
  absl::string_view bytes_;
  int32_t worker_id_ = 0;
  int64_t max_chunk_bytes_ = 0;
  uint64_t shard_incarnation_ = 0;
  size_t num_ranges_ = 0;
  size_t num_variables_ = 0;
};

// The pieces of a received grpc::ByteBuffer without copying: `slices` holds
// references that keep them alive, `pieces` points into them.
absl::Status DumpPieces(const grpc::ByteBuffer& buffer, std::vector<grpc::Slice>* slices,
                        std::vector<absl::string_view>* pieces);

}  // namespace psflow::wire

#endif  // PSFLOW_COMMON_GRPC_WIRE_H_
