// A borrowed, torch-free view of a tensor: what crosses from the bindings into kernels and
// transports. The bindings build it from a DLPack capsule after checking it; nothing below the
// bindings owns or frees the memory.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace asyncpp {

enum class DType : uint8_t { f32, f64, f16, bf16, i32, i64, u8, u16, boolean };
enum class DeviceKind : uint8_t { cpu, cuda };

int dtype_size(DType t);
const char* dtype_name(DType t);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  DeviceKind device = DeviceKind::cpu;
  int device_index = 0;
  std::vector<int64_t> shape;
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
