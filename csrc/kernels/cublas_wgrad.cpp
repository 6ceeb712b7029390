#include "kernels/cublas_wgrad.h"

#include <dlfcn.h>

#include <climits>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace asyncpp::kernels::blas {
namespace {

// The cuBLAS ABI values this file uses (cublas_api.h, library_types.h), declared here so that the
// build needs no cuBLAS headers.
constexpr int kOpN = 0;            // CUBLAS_OP_N
constexpr int kOpT = 1;            // CUBLAS_OP_T
constexpr int kR32F = 0;           // CUDA_R_32F
constexpr int kR16BF = 14;         // CUDA_R_16BF
constexpr int kCompute32F = 68;    // CUBLAS_COMPUTE_32F
constexpr int kGemmDefault = -1;   // CUBLAS_GEMM_DEFAULT

using GemmEx = int (*)(void* handle, int transa, int transb, int m, int n, int k, const void* alpha,
                       const void* a, int a_type, int lda, const void* b, int b_type, int ldb,
                       const void* beta, void* c, int c_type, int ldc, int compute_type, int algo);
using GetStream = int (*)(void* handle, void** stream);

struct Api {
  GemmEx gemm_ex = nullptr;
  GetStream get_stream = nullptr;
  std::string library;
  std::string error;
};

// torch's cuBLAS, already in the process (RTLD_NOLOAD finds it by soname): the handle the call
// gets is torch's, and only the library that made it may use it. Nothing else is loaded. With a
// soname given (`prefer`: the one torch's CUDA version links), only that one is taken, so another
// major version another library may have loaded is never paired with torch's handle.
Api load(const std::string& prefer) {
  static const std::vector<std::string> kNames = {"libcublas.so.13", "libcublas.so.12", "libcublas.so.11",
                                                  "libcublas.so"};
  Api api;
  for (const std::string& name : prefer.empty() ? kNames : std::vector<std::string>{prefer}) {
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (!handle) continue;
    api.gemm_ex = reinterpret_cast<GemmEx>(dlsym(handle, "cublasGemmEx"));
    // The header maps cublasGetStream to the _v2 symbol; the plain name is the fallback should a
    // release export only that.
    void* get_stream = dlsym(handle, "cublasGetStream_v2");
    api.get_stream = reinterpret_cast<GetStream>(get_stream ? get_stream : dlsym(handle, "cublasGetStream"));
    if (api.gemm_ex && api.get_stream) {
      api.library = name;
      return api;
    }
  }
  api.error = "torch has no cuBLAS loaded in this process (" +
              (prefer.empty() ? std::string("libcublas.so.13/.12/.11") : prefer) +
              " with cublasGemmEx and cublasGetStream); the fusion multiplies with torch's own: run on a CUDA build of torch with a "
              "GPU, or turn off --gradient-accumulation-fusion";
  return api;
}

std::mutex g_mutex;
std::string g_prefer;  // set_cublas_soname's
Api g_api;  // the library once found; looked for again until then (torch loads it at its first use)

Api api() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_api.gemm_ex == nullptr) g_api = load(g_prefer);
  return g_api;
}

}  // namespace

void set_cublas_soname(const std::string& soname) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (soname == g_prefer) return;
  g_prefer = soname;
  g_api = Api{};  // looked for again under the new name
}

std::string cublas_library() {
  const Api a = api();
  return a.error.empty() ? a.library : a.error;
}

void add_weight_gradient(const WeightGradient& w) {
  const Api a = api();
  ASYNCPP_CHECK(a.error.empty(), a.error);
  ASYNCPP_CHECK(w.rows <= INT_MAX && w.out <= INT_MAX && w.in <= INT_MAX,
                "add_weight_gradient: a dimension over 2^31 - 1 (", w.rows, " x ", w.out, " x ", w.in, ")");
  void* on = nullptr;
  int status = a.get_stream(w.handle, &on);
  ASYNCPP_CHECK(status == 0, "cublasGetStream failed with cuBLAS status ", status);
  ASYNCPP_CHECK(on == w.stream, "the cuBLAS handle is on another stream than the tensors' current one; "
                "pass the handle torch.cuda.current_blas_handle() returns on this stream");
  if (w.rows == 0 || w.out == 0 || w.in == 0) return;  // nothing to add (cuBLAS would scale by beta = 1)
  const float one = 1.0f;
  // Column-major terms: C (in x out, ld in) is main_grad's row-major (out x in); A = inputs as
  // (in x T), B = grad_output as (out x T) transposed: C += A @ B^T = (grad_output^T @ inputs)^T.
  status = a.gemm_ex(w.handle, kOpN, kOpT, int(w.in), int(w.out), int(w.rows), &one,
                     w.inputs, kR16BF, int(w.in), w.grad_output, kR16BF, int(w.out), &one,
                     w.main_grad, kR32F, int(w.in), kCompute32F, kGemmDefault);
  ASYNCPP_CHECK(status == 0, "cublasGemmEx (bf16 x bf16 into float32) failed with cuBLAS status ", status);
}

}  // namespace asyncpp::kernels::blas
