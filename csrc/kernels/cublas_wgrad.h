// A linear layer's weight gradient added into a float32 buffer by the matrix product itself:
// main_grad (out x in, float32) += grad_output^T (out x T, bf16) @ inputs (T x in, bf16), summed in
// float32 and written once (cuBLAS's GEMM with beta = 1), instead of a bf16 product that a second
// kernel reads back and adds (pipeline/main_grad.py; docs/design.md §2.13). For a torch whose addmm
// cannot write a float32 output from bf16 operands (out_dtype), which main_grad.py uses first.
//
// cuBLAS is the library torch already loaded: found at run time with dlopen (RTLD_NOLOAD: no other
// copy is ever loaded; by the soname of torch's CUDA major version, set_cublas_soname), so nothing links it and a build without CUDA compiles this file too. The handle is torch's (its current stream and
// workspace already set by torch.cuda.current_blas_handle(), which is also what makes the call
// legal inside a CUDA-graph capture: no workspace is allocated there).
#pragma once
#include <cstdint>
#include <string>

namespace asyncpp::kernels::blas {

struct WeightGradient {
  void* handle = nullptr;        // cublasHandle_t
  void* stream = nullptr;        // the stream the handle must be on (cudaStream_t)
  float* main_grad = nullptr;    // out x in, row-major, contiguous
  const void* grad_output = nullptr;  // T x out, bf16, row-major, contiguous
  const void* inputs = nullptr;  // T x in, bf16, row-major, contiguous
  int64_t rows = 0;              // T
  int64_t out = 0;
  int64_t in = 0;
};

// Throws asyncpp::Error (one line naming the cause) when cuBLAS cannot be found or refuses.
void add_weight_gradient(const WeightGradient& args);

// The library add_weight_gradient uses (torch's, found among the loaded ones), or why none is found.
std::string cublas_library();

// Take only this soname (e.g. "libcublas.so.12": the one torch's CUDA version links); "" = the
// newest loaded one.
void set_cublas_soname(const std::string& soname);

}  // namespace asyncpp::kernels::blas
