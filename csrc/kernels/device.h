// Device queries usable from a torch-free build. Without CUDA compiled in, they report no device.
#pragma once
#include <string>

namespace asyncpp::kernels {
// Number of CUDA devices the runtime sees; 0 when CUDA is not compiled in or no driver/GPU.
int cuda_device_count();
// Why cuda_device_count() is 0 ("" when it is not).
std::string cuda_status();
// OpenMP threads the CPU kernels use (1 without OpenMP).
int cpu_threads();
}  // namespace asyncpp::kernels
