#include "common/tensor_checks.h"

#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace psflow {
namespace {

// Writes `values` at byte offset `shift` of a fresh buffer and scans there.
int64_t ScanAt(const std::vector<float>& values, size_t shift) {
  std::vector<char> bytes(values.size() * 4 + shift + 1, 0);
  std::memcpy(bytes.data() + shift, values.data(), values.size() * 4);
  return FirstNonFinite(bytes.data() + shift, static_cast<int64_t>(values.size()));
}

TEST(TensorChecksTest, FiniteValuesPassIncludingExtremes) {
  const std::vector<float> values = {0.0f, -0.0f, 1.0f, -1.0f,
                                     std::numeric_limits<float>::max(),
                                     std::numeric_limits<float>::lowest(),
                                     std::numeric_limits<float>::min(),
                                     std::numeric_limits<float>::denorm_min()};
  EXPECT_EQ(FirstNonFinite(values.data(), static_cast<int64_t>(values.size())), -1);
  EXPECT_EQ(FirstNonFinite(values.data(), 0), -1);
}

TEST(TensorChecksTest, FindsTheFirstNonFiniteAtEveryPositionAndAlignment) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::signaling_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  // 67 elements: past several 16-float vectors plus a remainder.
  for (float b : bad) {
    for (size_t shift = 0; shift < 4; ++shift) {
      for (int pos = 0; pos < 67; ++pos) {
        std::vector<float> values(67, 0.5f);
        values[pos] = b;
        if (pos + 5 < 67) values[pos + 5] = b;  // a later one must not win
        ASSERT_EQ(ScanAt(values, shift), pos) << "value " << b << " shift " << shift;
      }
    }
  }
}

TEST(TensorChecksTest, LengthBoundsTheScan) {
  std::vector<float> values(40, 1.0f);
  values[32] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FirstNonFinite(values.data(), 32), -1);
  EXPECT_EQ(FirstNonFinite(values.data(), 33), 32);
}

}  // namespace
}  // namespace psflow
