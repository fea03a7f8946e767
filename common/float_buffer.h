// FloatBuffer: a fixed-size, 64-byte aligned float array for long-lived
// tensors (parameters, optimizer slots, staging buffers). Large buffers ask
// the kernel for transparent huge pages, which cuts the first-touch cost of
// fresh memory (about 12 us per 4 KiB page on these machines); buffers of
// 256 KiB or more own whole pages (nothing else shares a page with them, so
// they can be page-locked for DMA on their own). Allocate once, reuse.
// Movable, not copyable, not thread-safe.
#ifndef PSFLOW_COMMON_FLOAT_BUFFER_H_
#define PSFLOW_COMMON_FLOAT_BUFFER_H_

#include <cstddef>
#include <cstdint>

namespace psflow {

class FloatBuffer {
 public:
  FloatBuffer() = default;
  // `size` floats, every one set to `fill`.
  explicit FloatBuffer(int64_t size, float fill = 0.0f);
  // Buffers of at least this many bytes own whole pages (see above); the
  // worker pins those of its tensors for a GPU backend.
  static constexpr size_t kOwnPagesBytes = 256 * 1024;
  ~FloatBuffer();
  FloatBuffer(FloatBuffer&& other) noexcept;
  FloatBuffer& operator=(FloatBuffer&& other) noexcept;
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  int64_t size() const { return size_; }
  float& operator[](int64_t i) { return data_[i]; }
  float operator[](int64_t i) const { return data_[i]; }

 private:
  float* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_FLOAT_BUFFER_H_
