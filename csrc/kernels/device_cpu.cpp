#include "kernels/device.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace asyncpp::kernels {

int cpu_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

#ifndef ASYNCPP_WITH_CUDA
int cuda_device_count() { return 0; }
std::string cuda_status() { return "CUDA kernels not compiled"; }
#endif

}  // namespace asyncpp::kernels
