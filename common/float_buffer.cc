#include "common/float_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <utility>

namespace psflow {
namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

FloatBuffer::FloatBuffer(int64_t size, float fill) : size_(size) {
  if (size <= 0) {
    size_ = 0;
    return;
  }
  const size_t bytes = static_cast<size_t>(size) * sizeof(float);
  // Buffers of 256 KiB or more get whole pages of their own (start and end
  // on a page boundary), so that pinning one for DMA never touches another.
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t align = bytes >= kHugePage ? kHugePage : bytes >= kOwnPagesBytes ? page : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) throw std::bad_alloc();
  if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);
  data_ = static_cast<float*>(p);
  std::fill(data_, data_ + size_, fill);
}

FloatBuffer::~FloatBuffer() { std::free(data_); }

FloatBuffer::FloatBuffer(FloatBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

FloatBuffer& FloatBuffer::operator=(FloatBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace psflow
