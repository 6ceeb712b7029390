// A borrowed, torch-free view of a tensor: what crosses from the bindings into kernels and
// transports. The bindings build it from a DLPack capsule after checking it; nothing below the
// bindings owns or frees the memory.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

namespace asyncpp {

enum class DType : uint8_t { f32, f64, f16, bf16, i32, i64, u8, u16, boolean };
enum class DeviceKind : uint8_t { cpu, cuda };

int dtype_size(DType t);
const char* dtype_name(DType t);

// A tensor's sizes, held inline so that making or copying a view allocates nothing (transports
// make one per message). The bindings refuse tensors of more than kMaxDims dimensions.
struct Shape {
  static constexpr int kMaxDims = 8;
  std::array<int64_t, kMaxDims> dims{};
  int ndim = 0;

  const int64_t* begin() const { return dims.data(); }
  const int64_t* end() const { return dims.data() + ndim; }
  bool operator==(const Shape& o) const { return ndim == o.ndim && std::equal(begin(), end(), o.begin()); }
  bool operator!=(const Shape& o) const { return !(*this == o); }
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  DeviceKind device = DeviceKind::cpu;
  int device_index = 0;
  Shape shape;
  bool contiguous = true;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t nbytes() const { return numel() * dtype_size(dtype); }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

}  // namespace asyncpp
