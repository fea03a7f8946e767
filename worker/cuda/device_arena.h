// Arena: hands out aligned slices of one allocation made elsewhere. The CUDA
// backend runs the same carving code twice: once over a measuring arena to
// learn the total size (the slices are never dereferenced), then over the
// real allocation, so the measured and the used layout cannot disagree.
// CUDA-free; not thread-safe.
#ifndef PSFLOW_WORKER_CUDA_DEVICE_ARENA_H_
#define PSFLOW_WORKER_CUDA_DEVICE_ARENA_H_

#include <cstddef>
#include <cstdint>

namespace psflow::worker::cuda_internal {

class Arena {
 public:
  // 256 bytes: cudaMalloc's own alignment, enough for every cuDNN/cuBLAS
  // vectorised access.
  static constexpr size_t kAlignment = 256;
  static constexpr size_t RoundUp(size_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  // A measuring arena: slices are fake, non-null, aligned addresses.
  static Arena Measuring() { return Arena(kAlignment); }
  // `base` must be kAlignment-aligned and own at least size() bytes once
  // carving is done.
  explicit Arena(uintptr_t base) : base_(base) {}

  // A slice of `count` elements of T (count <= 0 gives an empty slice that
  // still has its own address).
  template <typename T>
  T* Take(int64_t count) {
    T* p = reinterpret_cast<T*>(base_ + offset_);
    const size_t bytes = count > 0 ? static_cast<size_t>(count) * sizeof(T) : 0;
    offset_ += RoundUp(bytes > 0 ? bytes : 1);
    return p;
  }

  // Bytes handed out so far, alignment included.
  size_t size() const { return offset_; }

 private:
  uintptr_t base_;
  size_t offset_ = 0;
};

}  // namespace psflow::worker::cuda_internal

#endif  // PSFLOW_WORKER_CUDA_DEVICE_ARENA_H_
