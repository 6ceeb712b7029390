#include <cuda_runtime.h>

#include "kernels/device.h"

namespace asyncpp::kernels {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device/driver" error
    return 0;
  }
  return n;
}

std::string cuda_status() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return cudaGetErrorString(err);
  }
  return n > 0 ? "" : "no CUDA device";
}

}  // namespace asyncpp::kernels
