// Which instruction set the CPU optimizer loops run with. The package is built for the baseline
// ISA of the target (x86-64: SSE2) so it runs anywhere; on x86-64 with GCC the hot loops are also
// compiled for AVX2 and AVX-512, and the loader picks the best clone this CPU supports (function
// multi-versioning). The kernels are compiled with -ffp-contract=off, so every clone rounds exactly
// like the baseline. Build with CXXFLAGS=-DASYNCPP_NO_ISA_CLONES for the baseline only.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(ASYNCPP_NO_ISA_CLONES)
#define ASYNCPP_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define ASYNCPP_HAS_ISA_CLONES 1
#else
#define ASYNCPP_ISA_CLONES
#define ASYNCPP_HAS_ISA_CLONES 0
#endif

namespace asyncpp::kernels {
// The clone the loader chose here: "avx512f", "avx2" or "baseline" (same priority order).
inline const char* cpu_kernel_isa() {
#if ASYNCPP_HAS_ISA_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "avx512f";
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "baseline";
}
}  // namespace asyncpp::kernels
