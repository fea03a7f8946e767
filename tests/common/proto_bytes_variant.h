// protobuf's parser for psflow.proto with Segment.variable declared `bytes`
// instead of `string`: the same wire format, without proto3's UTF-8 check.
// The shard's zero-copy push decoder (common/grpc_wire.h) leaves that check
// to the variable lookup (no variable has a name that is not UTF-8, so such
// a segment is NOT_FOUND); tests compare it with this parser.
#ifndef PSFLOW_TESTS_COMMON_PROTO_BYTES_VARIANT_H_
#define PSFLOW_TESTS_COMMON_PROTO_BYTES_VARIANT_H_

#include <memory>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "gtest/gtest.h"
#include "psflow.pb.h"

namespace psflow::test_support {

// A new, empty message of `full_name` (e.g. "psflow.PushRequest") from the
// variant.
inline std::unique_ptr<google::protobuf::Message> NewBytesVariant(const std::string& full_name) {
  using google::protobuf::DescriptorPool;
  using google::protobuf::DynamicMessageFactory;
  static DescriptorPool* const pool = [] {
    google::protobuf::FileDescriptorProto file;
    PushRequest::descriptor()->file()->CopyTo(&file);
    for (google::protobuf::DescriptorProto& m : *file.mutable_message_type()) {
      for (google::protobuf::FieldDescriptorProto& f : *m.mutable_field()) {
        if (m.name() == "Segment" && f.name() == "variable") {
          f.set_type(google::protobuf::FieldDescriptorProto::TYPE_BYTES);
        }
      }
    }
    auto* built = new DescriptorPool();
    EXPECT_NE(built->BuildFile(file), nullptr);
    return built;
  }();
  static DynamicMessageFactory* const factory = new DynamicMessageFactory(pool);
  const google::protobuf::Descriptor* type = pool->FindMessageTypeByName(full_name);
  EXPECT_NE(type, nullptr) << full_name;
  if (type == nullptr) return nullptr;
  return std::unique_ptr<google::protobuf::Message>(factory->GetPrototype(type)->New());
}

}  // namespace psflow::test_support

#endif  // PSFLOW_TESTS_COMMON_PROTO_BYTES_VARIANT_H_
