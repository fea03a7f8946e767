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

// Several tensors laid end to end and split into parts for threads: a bad
// value is found wherever it lies, at every tensor's and every part's
// edges included, with one thread or several; a finite set is not flagged.
TEST(TensorChecksTest, SeveralTensorsAreScannedByParts) {
  std::vector<std::vector<float>> storage = {
      std::vector<float>(3, 1.0f), std::vector<float>(5003, 1.0f), std::vector<float>(),
      std::vector<float>(1, 1.0f), std::vector<float>(2999, 1.0f)};
  std::vector<FloatRange> tensors;
  int64_t total = 0;
  for (const auto& t : storage) {
    tensors.push_back({t.data(), static_cast<int64_t>(t.size())});
    total += static_cast<int64_t>(t.size());
  }
  for (int threads : {1, 3, 7}) {
    ASSERT_FALSE(AnyNonFinite(tensors, threads, /*min_part=*/1000)) << threads;
  }
  // The positions to try, end to end: every tensor's first and last
  // element, and the elements around each part edge of 3 and 7 parts.
  std::vector<int64_t> positions;
  int64_t base = 0;
  for (const auto& t : storage) {
    if (t.empty()) continue;
    positions.push_back(base);
    positions.push_back(base + static_cast<int64_t>(t.size()) - 1);
    base += static_cast<int64_t>(t.size());
  }
  for (int parts : {3, 7}) {
    for (int p = 1; p < parts; ++p) {
      for (int64_t d : {-1, 0, 1}) positions.push_back(total * p / parts + d);
    }
  }
  for (const int64_t at : positions) {
    int64_t t = 0, i = at;  // tensor t, element i
    while (i >= static_cast<int64_t>(storage[t].size())) i -= storage[t++].size();
    storage[t][i] = std::numeric_limits<float>::infinity();
    for (int threads : {1, 3, 7}) {
      EXPECT_TRUE(AnyNonFinite(tensors, threads, /*min_part=*/1000))
          << "element " << at << ", " << threads << " threads";
    }
    storage[t][i] = 1.0f;
  }
  // Parts of at least min_part: 8006 elements make one part of 10,000.
  storage[4][2998] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(AnyNonFinite(tensors, 8, /*min_part=*/10000));
  EXPECT_FALSE(AnyNonFinite({}, 4));
}

}  // namespace
}  // namespace psflow
