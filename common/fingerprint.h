// Fnv1a64: the 64-bit FNV-1a hash that psflow's fingerprints use (the
// partition plan's, the model's). Integers are fed as 8 little-endian bytes
// and strings with their length first, so a fingerprint depends only on
// values, never on the platform, the build or std::hash.
#ifndef PSFLOW_COMMON_FINGERPRINT_H_
#define PSFLOW_COMMON_FINGERPRINT_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace psflow {

class Fnv1a64 {
 public:
  void AddBytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= 0x100000001b3ULL;
    }
  }
  void AddInt(int64_t v) {
    unsigned char b[8];
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(u >> (8 * i));
    AddBytes(b, sizeof(b));
  }
  void AddString(std::string_view s) {
    AddInt(static_cast<int64_t>(s.size()));
    AddBytes(s.data(), s.size());
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_FINGERPRINT_H_
