#include "bindings/tensor_args.h"

#include <algorithm>

#include "bindings/dlpack_abi.h"
#include "core/error.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {

DType to_dtype(const DLDataType& t, const char* arg_name) {
  ASYNCPP_ARG_CHECK(t.lanes == 1, arg_name, ": vectorized dtypes (lanes=", t.lanes, ") are not supported");
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 32) return DType::f32;
      if (t.bits == 64) return DType::f64;
      if (t.bits == 16) return DType::f16;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::bf16;
      break;
    case kDLInt:
      if (t.bits == 32) return DType::i32;
      if (t.bits == 64) return DType::i64;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::u8;
      if (t.bits == 16) return DType::u16;
      break;
    case kDLBool:
      return DType::boolean;
  }
  ASYNCPP_ARG_CHECK(false, arg_name, ": unsupported dtype (DLPack code ", int(t.code), ", ", int(t.bits),
                    " bits); convert the tensor to float32/bfloat16/float16/float64 first");
}

}  // namespace

TensorView borrow_tensor(const py::handle& capsule, const char* arg_name) {
  ASYNCPP_ARG_CHECK(PyCapsule_CheckExact(capsule.ptr()) && PyCapsule_IsValid(capsule.ptr(), "dltensor"),
                    arg_name, ": expected a DLPack capsule from torch.utils.dlpack.to_dlpack(tensor) "
                    "(an already-consumed capsule cannot be reused)");
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  TensorView v;
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.dtype = to_dtype(t.dtype, arg_name);
  if (t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost) {
    v.device = DeviceKind::cpu;
  } else if (t.device.device_type == kDLCUDA || t.device.device_type == kDLCUDAManaged) {
    v.device = DeviceKind::cuda;
  } else {
    ASYNCPP_ARG_CHECK(false, arg_name, ": tensors on DLPack device type ", t.device.device_type,
                      " are not supported; use a CPU or CUDA tensor");
  }
  v.device_index = t.device.device_id;
  ASYNCPP_ARG_CHECK(t.ndim >= 0 && t.ndim <= Shape::kMaxDims, arg_name, ": tensors of ", t.ndim,
                    " dimensions are not supported (at most ", Shape::kMaxDims, "); reshape it first");
  v.shape.ndim = t.ndim;
  std::copy(t.shape, t.shape + t.ndim, v.shape.dims.begin());
  // Row-major compact check; size-1 dimensions may carry any stride.
  v.contiguous = true;
  if (t.strides != nullptr) {
    int64_t expected = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (t.shape[d] != 1 && t.strides[d] != expected) v.contiguous = false;
      expected *= t.shape[d];
    }
  }
  return v;
}

std::vector<TensorView> borrow_tensors(const py::sequence& capsules, const char* arg_name) {
  std::vector<TensorView> out;
  out.reserve(py::len(capsules));
  size_t i = 0;
  for (const auto& c : capsules) {
    std::string name = std::string(arg_name) + "[" + std::to_string(i++) + "]";
    out.push_back(borrow_tensor(c, name.c_str()));
  }
  return out;
}

void expect_dtype(const TensorView& t, DType want, const std::string& arg_name) {
  ASYNCPP_ARG_CHECK(t.dtype == want, arg_name, ": expected dtype ", dtype_name(want), ", got ",
                    dtype_name(t.dtype));
}

void expect_device(const TensorView& t, DeviceKind want, const std::string& arg_name) {
  ASYNCPP_ARG_CHECK(t.device == want, arg_name, ": expected a ", (want == DeviceKind::cpu ? "CPU" : "CUDA"),
                    " tensor, got a ", (t.device == DeviceKind::cpu ? "CPU" : "CUDA"),
                    " tensor; move it with .to(...) first");
}

void expect_contiguous(const TensorView& t, const std::string& arg_name) {
  ASYNCPP_ARG_CHECK(t.contiguous, arg_name, ": expected a contiguous tensor; call .contiguous() first");
}

void expect_same_shape(const TensorView& a, const TensorView& b, const std::string& a_name,
                       const std::string& b_name) {
  ASYNCPP_ARG_CHECK(a.shape == b.shape, a_name, " and ", b_name, " must have the same shape (",
                    a.numel(), " vs ", b.numel(), " elements)");
}

}  // namespace asyncpp::bindings
