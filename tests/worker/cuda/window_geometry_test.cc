#include "worker/cuda/window_geometry.h"

#include "absl/status/status.h"
#include "gtest/gtest.h"

// CUDA-free, so it runs in every build, with or without the CUDA toolkit.
namespace psflow::worker {
namespace {

// Keras/TF window arithmetic, worked by hand from TF's formulas (no GPU).
TEST(WindowGeometryTest, MatchesKerasPadding) {
  using cuda_internal::ComputeWindow;
  struct Case {
    int in, kernel, stride;
    bool same;
    int out, before, after;
  };
  const Case cases[] = {
      {28, 3, 1, true, 28, 1, 1},   // total pad 2
      {28, 3, 2, true, 14, 0, 1},   // 13*2+3-28 = 1: the extra row goes last
      {10, 3, 2, true, 5, 0, 1},    // 4*2+3-10 = 1
      {5, 3, 2, true, 3, 1, 1},     // 2*2+3-5 = 2
      {9, 2, 2, true, 5, 0, 1},     // 4*2+2-9 = 1
      {6, 2, 1, true, 6, 0, 1},     // even kernel: 5+2-6 = 1
      {5, 1, 2, true, 3, 0, 0},     // 2*2+1-5 = 0
      {28, 3, 1, false, 26, 0, 0},  // (28-3)/1+1
      {13, 3, 2, false, 6, 0, 0},   // (13-3)/2+1
      {9, 2, 2, false, 4, 0, 0},    // (9-2)/2+1 = 4 (the last row is dropped)
  };
  for (const Case& c : cases) {
    auto g = ComputeWindow(c.in, c.kernel, c.stride, c.same);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->out, c.out) << c.in << "/" << c.kernel << "/" << c.stride;
    EXPECT_EQ(g->pad_before, c.before) << c.in << "/" << c.kernel << "/" << c.stride;
    EXPECT_EQ(g->pad_after, c.after) << c.in << "/" << c.kernel << "/" << c.stride;
  }
  EXPECT_EQ(ComputeWindow(4, 5, 1, false).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeWindow(4, 3, 0, true).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psflow::worker
