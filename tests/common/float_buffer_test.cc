// FloatBuffer: filled on creation, movable, and aligned so that big buffers
// own whole pages (a GPU backend pins them one by one for DMA).
#include "common/float_buffer.h"

#include <unistd.h>

#include <cstdint>
#include <utility>

#include "gtest/gtest.h"

namespace psflow {
namespace {

uintptr_t Address(const FloatBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); }
const uintptr_t kPage = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));

TEST(FloatBufferTest, FilledAndSized) {
  FloatBuffer b(1000, 2.5f);
  ASSERT_EQ(b.size(), 1000);
  for (int64_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], 2.5f) << i;
  FloatBuffer empty(0);
  EXPECT_EQ(empty.size(), 0);
  EXPECT_EQ(empty.data(), nullptr);
}

TEST(FloatBufferTest, MoveLeavesTheSourceEmpty) {
  FloatBuffer a(16, 1.0f);
  const float* data = a.data();
  FloatBuffer b(std::move(a));
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.size(), 16);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): the contract
  EXPECT_EQ(a.size(), 0);
  FloatBuffer c(4);
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c[15], 1.0f);
}

TEST(FloatBufferTest, BigBuffersOwnWholePages) {
  FloatBuffer small(100);
  EXPECT_EQ(Address(small) % 64, 0u);
  // 256 KiB and up: page-aligned; two of them never share a page.
  for (int64_t floats : {int64_t{65536}, int64_t{65536 + 3}, int64_t{400000}}) {
    FloatBuffer a(floats), b(floats);
    EXPECT_EQ(Address(a) % kPage, 0u) << floats;
    EXPECT_EQ(Address(b) % kPage, 0u) << floats;
    const uintptr_t a_last_page = (Address(a) + floats * 4 - 1) / kPage;
    const uintptr_t b_last_page = (Address(b) + floats * 4 - 1) / kPage;
    EXPECT_TRUE(a_last_page < Address(b) / kPage || b_last_page < Address(a) / kPage) << floats;
  }
  FloatBuffer huge(int64_t{3} << 20);  // 12 MiB: on huge-page boundaries
  EXPECT_EQ(Address(huge) % (2 << 20), 0u);
}

}  // namespace
}  // namespace psflow
