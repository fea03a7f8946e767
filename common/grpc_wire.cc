#include "common/grpc_wire.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/common.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace psflow::wire {
namespace {

enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLen = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5
};
// protobuf's default recursion limit: groups and nested messages together
// may nest this deep.
constexpr int kMaxDepth = 100;

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

char* PutVarint(char* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<char>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<char>(v);
  return p;
}

uint64_t Tag(int field, WireType type) { return (static_cast<uint64_t>(field) << 3) | type; }

// A read position in a list of pieces, bounded by `limit` (an absolute byte
// position; nested messages narrow it).
class Cursor {
 public:
  explicit Cursor(absl::Span<const absl::string_view> pieces) : pieces_(pieces) {
    for (absl::string_view p : pieces) limit_ += p.size();
    Normalize();
  }
  uint64_t pos() const { return pos_; }
  uint64_t limit() const { return limit_; }
  void set_limit(uint64_t limit) { limit_ = limit; }
  bool AtLimit() const { return pos_ >= limit_; }
  uint64_t Left() const { return limit_ - pos_; }

  bool ReadByte(uint8_t* b) {
    if (pos_ >= limit_) return false;
    *b = static_cast<uint8_t>(pieces_[piece_][in_piece_]);
    Advance(1);
    return true;
  }

  absl::Status ReadVarint(uint64_t* out, const char* what) {
    uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      uint8_t b;
      if (!ReadByte(&b)) {
        return absl::InvalidArgumentError(
            absl::StrCat("malformed message: truncated varint (", what, ") at byte ", pos_));
      }
      v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *out = v;
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(absl::StrCat("malformed message: varint (", what,
                                                   ") longer than 10 bytes at byte ", pos_));
  }

  absl::Status ReadFixed(int bytes, uint64_t* out, const char* what) {
    if (Left() < static_cast<uint64_t>(bytes)) return Truncated(what, bytes);
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      uint8_t b = 0;
      ReadByte(&b);
      v |= static_cast<uint64_t>(b) << (8 * i);
    }
    *out = v;
    return absl::OkStatus();
  }

  // Reads a length prefix and checks that the field fits inside the limit.
  // As protobuf, at most 5 bytes and below 2^31 (a length padded with
  // continuation bytes is refused).
  absl::Status ReadLength(uint64_t* len, const char* what) {
    const uint64_t at = pos_;
    if (absl::Status s = ReadVarint(len, what); !s.ok()) return s;
    if (pos_ - at > 5 || *len >= (uint64_t{1} << 31)) {
      return absl::InvalidArgumentError(absl::StrCat("malformed message: length of ", what,
                                                     " at byte ", at, " takes ", pos_ - at,
                                                     " bytes or is 2^31 or more"));
    }
    if (*len > Left()) {
      return absl::InvalidArgumentError(absl::StrCat("malformed message: ", what, " at byte ",
                                                     at, " claims ", *len, " bytes but only ",
                                                     Left(), " remain"));
    }
    return absl::OkStatus();
  }

  // Hands the next n bytes (n <= Left()) to fn as runs of contiguous memory.
  template <typename Fn>
  void Take(uint64_t n, Fn fn) {
    while (n > 0) {
      const absl::string_view p = pieces_[piece_];
      const uint64_t run = std::min<uint64_t>(n, p.size() - in_piece_);
      fn(p.substr(in_piece_, run));
      Advance(run);
      n -= run;
    }
  }
  void Skip(uint64_t n) {
    Take(n, [](absl::string_view) {});
  }

  absl::Status Truncated(const char* what, uint64_t need) const {
    return absl::InvalidArgumentError(absl::StrCat("malformed message: ", what, " at byte ", pos_,
                                                   " needs ", need, " bytes but only ", Left(),
                                                   " remain"));
  }

 private:
  void Advance(uint64_t n) {
    pos_ += n;
    in_piece_ += n;
    Normalize();
  }
  void Normalize() {
    while (piece_ < pieces_.size() && in_piece_ >= pieces_[piece_].size()) {
      in_piece_ -= pieces_[piece_].size();
      ++piece_;
    }
  }
  absl::Span<const absl::string_view> pieces_;
  size_t piece_ = 0;
  uint64_t in_piece_ = 0;
  uint64_t pos_ = 0;
  uint64_t limit_ = 0;
};

struct FieldTag {
  uint32_t field;
  uint32_t type;
};

// Reads a tag as protobuf does: a varint of at most 5 bytes whose bits past
// the 32nd are dropped.
absl::Status ReadTag(Cursor* c, FieldTag* tag) {
  const uint64_t at = c->pos();
  uint32_t raw = 0;
  for (int i = 0;; ++i) {
    if (i == 5) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed message: field tag longer than 5 bytes at byte ", at));
    }
    uint8_t b;
    if (!c->ReadByte(&b)) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed message: truncated varint (field tag) at byte ", c->pos()));
    }
    raw |= static_cast<uint32_t>(b & 0x7f) << (7 * i);
    if ((b & 0x80) == 0) break;
  }
  if (raw >> 3 == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed message: invalid field number ", raw >> 3, " at byte ", at));
  }
  tag->field = static_cast<uint32_t>(raw >> 3);
  tag->type = static_cast<uint32_t>(raw & 7);
  if (tag->type > kFixed32) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed message: invalid wire type ", tag->type, " at byte ", at));
  }
  return absl::OkStatus();
}

// Skips the value of an unknown field, as protobuf does (groups included).
// `depth`: the messages and groups the field lies in (0 at the top level).
absl::Status SkipField(Cursor* c, const FieldTag& tag, int depth) {
  uint64_t v;
  switch (tag.type) {
    case kVarint:
      return c->ReadVarint(&v, "unknown field");
    case kFixed64:
      if (c->Left() < 8) return c->Truncated("unknown fixed64 field", 8);
      c->Skip(8);
      return absl::OkStatus();
    case kFixed32:
      if (c->Left() < 4) return c->Truncated("unknown fixed32 field", 4);
      c->Skip(4);
      return absl::OkStatus();
    case kLen:
      if (absl::Status s = c->ReadLength(&v, "unknown field"); !s.ok()) return s;
      c->Skip(v);
      return absl::OkStatus();
    case kStartGroup:
      if (depth >= kMaxDepth) {
        return absl::InvalidArgumentError("malformed message: groups nested too deeply");
      }
      while (true) {
        if (c->AtLimit()) {
          return absl::InvalidArgumentError("malformed message: unterminated group");
        }
        FieldTag inner;
        if (absl::Status s = ReadTag(c, &inner); !s.ok()) return s;
        if (inner.type == kEndGroup) {
          if (inner.field != tag.field) {
            return absl::InvalidArgumentError(absl::StrCat(
                "malformed message: group ", tag.field, " closed by end of group ", inner.field));
          }
          return absl::OkStatus();
        }
        if (absl::Status s = SkipField(c, inner, depth + 1); !s.ok()) return s;
      }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("malformed message: unexpected end of group ", tag.field));
  }
}

absl::Status WrongType(const char* message, const char* field, const FieldTag& tag,
                       uint32_t expected) {
  return absl::InvalidArgumentError(absl::StrCat("malformed ", message, ": field ", field, " (",
                                                 tag.field, ") has wire type ", tag.type,
                                                 "; expected ", expected));
}

// Runs fn(tag) for every field up to the cursor's limit; fn consumes the
// value (or calls SkipField).
template <typename Fn>
absl::Status ForEachField(Cursor* c, Fn fn) {
  while (!c->AtLimit()) {
    FieldTag tag;
    if (absl::Status s = ReadTag(c, &tag); !s.ok()) return s;
    if (tag.type == kEndGroup) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed message: unexpected end of group ", tag.field));
    }
    if (absl::Status s = fn(tag); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Runs `body` with the cursor limited to the next `len` bytes.
template <typename Fn>
absl::Status Nested(Cursor* c, uint64_t len, Fn body) {
  const uint64_t outer = c->limit();
  c->set_limit(c->pos() + len);
  absl::Status s = body();
  c->set_limit(outer);
  return s;
}

absl::Status DecodeSegment(Cursor* c, DecodedMessage* out, DecodedSegment* seg) {
  return ForEachField(c, [&](const FieldTag& tag) -> absl::Status {
    uint64_t v = 0;
    switch (tag.field) {
      case 1:
        if (tag.type != kLen) return WrongType("Segment", "variable", tag, kLen);
        if (absl::Status s = c->ReadLength(&v, "Segment.variable"); !s.ok()) return s;
        seg->variable.clear();
        c->Take(v, [&](absl::string_view run) { seg->variable.append(run.data(), run.size()); });
        return absl::OkStatus();
      case 2:
        if (tag.type != kVarint) return WrongType("Segment", "offset", tag, kVarint);
        if (absl::Status s = c->ReadVarint(&v, "Segment.offset"); !s.ok()) return s;
        seg->offset = static_cast<int64_t>(v);
        return absl::OkStatus();
      case 3:
        if (tag.type != kLen) return WrongType("Segment", "data", tag, kLen);
        if (absl::Status s = c->ReadLength(&v, "Segment.data"); !s.ok()) return s;
        // The last occurrence wins, as in protobuf.
        seg->first_run = out->data_runs.size();
        seg->data_bytes = static_cast<int64_t>(v);
        c->Take(v, [&](absl::string_view run) { out->data_runs.push_back(run); });
        seg->num_runs = out->data_runs.size() - seg->first_run;
        return absl::OkStatus();
      default:
        return SkipField(c, tag, 1);
    }
  });
}

absl::Status DecodePushHeader(Cursor* c, PushHeaderFields* h) {
  static const char* const kNames[] = {"", "worker_id", "step", "read_version"};
  return ForEachField(c, [&](const FieldTag& tag) -> absl::Status {
    uint64_t v = 0;
    switch (tag.field) {
      case 1:
      case 2:
      case 3:
        if (tag.type != kVarint) return WrongType("PushHeader", kNames[tag.field], tag, kVarint);
        if (absl::Status s = c->ReadVarint(&v, kNames[tag.field]); !s.ok()) return s;
        if (tag.field == 1) h->worker_id = static_cast<int32_t>(v);
        if (tag.field == 2) h->step = static_cast<int64_t>(v);
        if (tag.field == 3) h->read_version = static_cast<int64_t>(v);
        return absl::OkStatus();
      case 4:
        if (tag.type != kFixed64) return WrongType("PushHeader", "request_id", tag, kFixed64);
        return c->ReadFixed(8, &h->request_id, "PushHeader.request_id");
      case 5:
        if (tag.type != kVarint) return WrongType("PushHeader", "gradient_checked", tag, kVarint);
        if (absl::Status s = c->ReadVarint(&v, "gradient_checked"); !s.ok()) return s;
        h->gradient_checked = v != 0;  // as protobuf reads a bool
        return absl::OkStatus();
      case 6:
        if (tag.type != kFixed64) {
          return WrongType("PushHeader", "shard_incarnation", tag, kFixed64);
        }
        return c->ReadFixed(8, &h->shard_incarnation, "PushHeader.shard_incarnation");
      default:
        return SkipField(c, tag, 1);
    }
  });
}

}  // namespace

void AppendVarint(std::string* out, uint64_t value) {
  char buf[10];
  out->append(buf, PutVarint(buf, value) - buf);
}

size_t MaxSegmentPrefixSize(absl::string_view variable) {
  return 4 * 10 + 3 + 10 + variable.size();
}

namespace {
// The length of a Segment's body: proto3 leaves fields at their default
// out, as the generated code does.
size_t SegmentBodySize(absl::string_view variable, int64_t offset, size_t data_bytes) {
  size_t body = 0;
  if (!variable.empty()) body += 1 + VarintSize(variable.size()) + variable.size();
  if (offset != 0) body += 1 + VarintSize(static_cast<uint64_t>(offset));
  if (data_bytes != 0) body += 1 + VarintSize(data_bytes) + data_bytes;
  return body;
}
}  // namespace

size_t SegmentPrefixSize(int field, absl::string_view variable, int64_t offset,
                         size_t data_bytes) {
  const size_t body = SegmentBodySize(variable, offset, data_bytes);
  return VarintSize(Tag(field, kLen)) + VarintSize(body) + body - data_bytes;
}

size_t WriteSegmentPrefix(char* out, int field, absl::string_view variable, int64_t offset,
                          size_t data_bytes) {
  const size_t body = SegmentBodySize(variable, offset, data_bytes);
  char* p = PutVarint(out, Tag(field, kLen));
  p = PutVarint(p, body);
  if (!variable.empty()) {
    p = PutVarint(p, Tag(1, kLen));
    p = PutVarint(p, variable.size());
    std::memcpy(p, variable.data(), variable.size());
    p += variable.size();
  }
  if (offset != 0) {
    p = PutVarint(p, Tag(2, kVarint));
    p = PutVarint(p, static_cast<uint64_t>(offset));
  }
  if (data_bytes != 0) {
    p = PutVarint(p, Tag(3, kLen));
    p = PutVarint(p, data_bytes);
  }
  return static_cast<size_t>(p - out);
}

size_t AppendSegmentPrefix(std::string* out, int field, absl::string_view variable,
                           int64_t offset, size_t data_bytes) {
  const size_t old = out->size();
  out->resize(old + MaxSegmentPrefixSize(variable));
  const size_t n = WriteSegmentPrefix(out->data() + old, field, variable, offset, data_bytes);
  out->resize(old + n);
  return n;
}

namespace {
// A fixed64 field's value: 8 bytes, little-endian.
void AppendFixed64(std::string* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}
}  // namespace

void AppendPushHeader(std::string* out, const PushHeaderFields& h) {
  std::string body;
  if (h.worker_id != 0) {
    AppendVarint(&body, Tag(1, kVarint));
    // int32 is sign-extended to 64 bits on the wire.
    AppendVarint(&body, static_cast<uint64_t>(static_cast<int64_t>(h.worker_id)));
  }
  if (h.step != 0) {
    AppendVarint(&body, Tag(2, kVarint));
    AppendVarint(&body, static_cast<uint64_t>(h.step));
  }
  if (h.read_version != 0) {
    AppendVarint(&body, Tag(3, kVarint));
    AppendVarint(&body, static_cast<uint64_t>(h.read_version));
  }
  if (h.request_id != 0) {
    AppendVarint(&body, Tag(4, kFixed64));
    AppendFixed64(&body, h.request_id);
  }
  if (h.gradient_checked) {
    AppendVarint(&body, Tag(5, kVarint));
    AppendVarint(&body, 1);
  }
  if (h.shard_incarnation != 0) {
    AppendVarint(&body, Tag(6, kFixed64));
    AppendFixed64(&body, h.shard_incarnation);
  }
  AppendVarint(out, Tag(1, kLen));
  AppendVarint(out, body.size());
  out->append(body);
}

void AppendPackedInt64(std::string* out, int field, absl::Span<const int64_t> values) {
  if (values.empty()) return;
  size_t len = 0;
  for (int64_t v : values) len += VarintSize(static_cast<uint64_t>(v));
  AppendVarint(out, Tag(field, kLen));
  AppendVarint(out, len);
  for (int64_t v : values) AppendVarint(out, static_cast<uint64_t>(v));
}

void DecodedMessage::Clear() {
  has_header = false;
  header = PushHeaderFields();
  num_segments = 0;
  data_runs.clear();
  versions.clear();
}

void DecodedMessage::CopyData(const DecodedSegment& s, void* out) const {
  char* p = static_cast<char*>(out);
  for (size_t i = 0; i < s.num_runs; ++i) {
    const absl::string_view run = data_runs[s.first_run + i];
    std::memcpy(p, run.data(), run.size());
    p += run.size();
  }
}

size_t MaxSegments(size_t message_bytes) { return 1024 + message_bytes / 8; }

absl::Status Decode(MessageKind kind, absl::Span<const absl::string_view> pieces,
                    DecodedMessage* out) {
  out->Clear();
  Cursor c(pieces);
  const bool push = kind == MessageKind::kPushRequest;
  const char* message = push ? "PushRequest" : "PullResponse";
  const uint32_t segments_field = push ? 2 : 1;
  size_t bytes = 0;
  for (absl::string_view piece : pieces) bytes += piece.size();
  const size_t most_segments = MaxSegments(bytes);
  return ForEachField(&c, [&](const FieldTag& tag) -> absl::Status {
    uint64_t v = 0;
    if (tag.field == segments_field) {
      if (tag.type != kLen) return WrongType(message, "segments", tag, kLen);
      if (out->num_segments == most_segments) {
        return absl::InvalidArgumentError(absl::StrCat(
            message, " has more than ", most_segments, " segments in its ", bytes,
            " bytes; a segment that carries data takes at least 8, so most of these carry none "
            "(each would cost the receiver about 64 bytes to decode)"));
      }
      if (absl::Status s = c.ReadLength(&v, "segment"); !s.ok()) return s;
      if (out->num_segments == out->segments.size()) out->segments.emplace_back();
      DecodedSegment* seg = &out->segments[out->num_segments++];
      seg->variable.clear();
      seg->offset = 0;
      seg->data_bytes = 0;
      seg->first_run = out->data_runs.size();
      seg->num_runs = 0;
      return Nested(&c, v, [&] { return DecodeSegment(&c, out, seg); });
    }
    if (push && tag.field == 1) {
      if (tag.type != kLen) return WrongType(message, "header", tag, kLen);
      if (absl::Status s = c.ReadLength(&v, "PushRequest.header"); !s.ok()) return s;
      out->has_header = true;  // a repeated header merges, as in protobuf
      return Nested(&c, v, [&] { return DecodePushHeader(&c, &out->header); });
    }
    if (!push && tag.field == 2) {
      if (tag.type == kVarint) {  // unpacked
        if (absl::Status s = c.ReadVarint(&v, "PullResponse.versions"); !s.ok()) return s;
        out->versions.push_back(static_cast<int64_t>(v));
        return absl::OkStatus();
      }
      if (tag.type != kLen) return WrongType(message, "versions", tag, kLen);
      if (absl::Status s = c.ReadLength(&v, "PullResponse.versions"); !s.ok()) return s;
      return Nested(&c, v, [&]() -> absl::Status {
        while (!c.AtLimit()) {
          uint64_t x = 0;
          if (absl::Status s = c.ReadVarint(&x, "PullResponse.versions"); !s.ok()) return s;
          out->versions.push_back(static_cast<int64_t>(x));
        }
        return absl::OkStatus();
      });
    }
    return SkipField(&c, tag, 0);
  });
}

namespace {

// Skips the next `len` bytes of `bytes` (the cursor's one piece), a proto3
// string, refused as protobuf refuses it when it is not UTF-8.
absl::Status SkipUtf8(Cursor* c, absl::string_view bytes, uint64_t len, const char* what) {
  const absl::string_view text = bytes.substr(c->pos(), len);
  if (!google::protobuf::internal::IsStructurallyValidUTF8(text.data(),
                                                           static_cast<int>(text.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed message: ", what, " at byte ", c->pos(), " is not UTF-8"));
  }
  c->Skip(len);
  return absl::OkStatus();
}

// A PullRange's fields; with `out` null, only checks them.
absl::Status DecodePullRange(Cursor* c, absl::string_view bytes, PullRangeFields* out) {
  static const char* const kNames[] = {"", "variable", "offset", "count"};
  return ForEachField(c, [&](const FieldTag& tag) -> absl::Status {
    uint64_t v = 0;
    switch (tag.field) {
      case 1:
        if (tag.type != kLen) return WrongType("PullRange", "variable", tag, kLen);
        if (absl::Status s = c->ReadLength(&v, "PullRange.variable"); !s.ok()) return s;
        if (out != nullptr) out->variable = bytes.substr(c->pos(), v);  // the last one wins
        return SkipUtf8(c, bytes, v, "PullRange.variable");
      case 2:
      case 3:
        if (tag.type != kVarint) return WrongType("PullRange", kNames[tag.field], tag, kVarint);
        if (absl::Status s = c->ReadVarint(&v, kNames[tag.field]); !s.ok()) return s;
        if (out != nullptr) (tag.field == 2 ? out->offset : out->count) = static_cast<int64_t>(v);
        return absl::OkStatus();
      default:
        return SkipField(c, tag, 1);
    }
  });
}

}  // namespace

absl::Status PullRequestView::Parse(absl::string_view bytes) {
  *this = PullRequestView();
  bytes_ = bytes;
  Cursor c(absl::MakeConstSpan(&bytes_, 1));
  return ForEachField(&c, [&](const FieldTag& tag) -> absl::Status {
    uint64_t v = 0;
    switch (tag.field) {
      case 1:
        if (tag.type != kVarint) return WrongType("PullRequest", "worker_id", tag, kVarint);
        if (absl::Status s = c.ReadVarint(&v, "PullRequest.worker_id"); !s.ok()) return s;
        worker_id_ = static_cast<int32_t>(v);
        return absl::OkStatus();
      case 2:
        if (tag.type != kLen) return WrongType("PullRequest", "variables", tag, kLen);
        if (absl::Status s = c.ReadLength(&v, "PullRequest.variables"); !s.ok()) return s;
        ++num_variables_;
        return SkipUtf8(&c, bytes_, v, "PullRequest.variables");
      case 3:
        if (tag.type != kVarint) return WrongType("PullRequest", "max_chunk_bytes", tag, kVarint);
        if (absl::Status s = c.ReadVarint(&v, "PullRequest.max_chunk_bytes"); !s.ok()) return s;
        max_chunk_bytes_ = static_cast<int64_t>(v);
        return absl::OkStatus();
      case 4:
        if (tag.type != kLen) return WrongType("PullRequest", "ranges", tag, kLen);
        if (absl::Status s = c.ReadLength(&v, "PullRequest.ranges"); !s.ok()) return s;
        ++num_ranges_;
        return Nested(&c, v, [&] { return DecodePullRange(&c, bytes_, nullptr); });
      case 5:
        if (tag.type != kFixed64) {
          return WrongType("PullRequest", "shard_incarnation", tag, kFixed64);
        }
        return c.ReadFixed(8, &shard_incarnation_, "PullRequest.shard_incarnation");
      default:
        return SkipField(&c, tag, 0);
    }
  });
}

// The message was checked by Parse, so nothing here can fail; a failure
// would end the walk early.
bool PullRequestView::Walker::NextEntry(uint32_t field, absl::string_view* body) {
  Cursor c(absl::MakeConstSpan(&bytes_, 1));
  c.Skip(pos_);
  bool found = false;
  while (!found && !c.AtLimit()) {
    FieldTag tag;
    uint64_t len = 0;
    if (!ReadTag(&c, &tag).ok()) break;
    if (tag.field == field && tag.type == kLen) {
      if (!c.ReadLength(&len, "entry").ok()) break;
      *body = bytes_.substr(c.pos(), len);
      c.Skip(len);
      found = true;
    } else if (!SkipField(&c, tag, 0).ok()) {
      break;
    }
  }
  pos_ = found ? c.pos() : bytes_.size();
  return found;
}

bool PullRequestView::Walker::NextRange(PullRangeFields* out) {
  absl::string_view body;
  if (!NextEntry(4, &body)) return false;
  *out = PullRangeFields();
  Cursor c(absl::MakeConstSpan(&body, 1));
  return DecodePullRange(&c, body, out).ok();
}

bool PullRequestView::Walker::NextVariable(absl::string_view* out) { return NextEntry(2, out); }

absl::Status DumpPieces(const grpc::ByteBuffer& buffer, std::vector<grpc::Slice>* slices,
                        std::vector<absl::string_view>* pieces) {
  slices->clear();
  pieces->clear();
  grpc::Status st = buffer.Dump(slices);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read a message: ", st.error_message()));
  }
  for (const grpc::Slice& s : *slices) {
    pieces->emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return absl::OkStatus();
}

}  // namespace psflow::wire
