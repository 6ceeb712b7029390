// The per-element loops of the CPU optimizer kernels, as one table of function pointers per ISA.
// optim_cpu_loops.inc holds the loops once; optim_cpu_{baseline,avx2,avx512f}.cpp each compile it
// in their own namespace with their own -m flags (CMakeLists.txt), and optim_cpu.cpp calls through
// the table cpu_isa_selection() picked. Separate translation units rather than target attributes:
// each variant is ordinary code the compiler vectorizes for its ISA, and nothing but the table
// crosses from one to another.
#pragma once
#include <cstdint>

#include "kernels/optim_kernels.h"

// Set by CMake, for this library only, where the AVX2 and AVX-512 units get their -m flags
// (x86-64 with GCC or Clang).
#if defined(ASYNCPP_ISA_VARIANTS) && !defined(ASYNCPP_NO_ISA_CLONES)
#define ASYNCPP_HAS_ISA_VARIANTS 1
#else
#define ASYNCPP_HAS_ISA_VARIANTS 0
#endif

namespace asyncpp::kernels::optim {

// Each function handles elements [begin, end) of one tensor.
struct CpuLoops {
  void (*adamw[kEfModes])(const AdamWTensor& t, int64_t begin, int64_t end);     // [EfMode]
  double (*momentum[2])(const MomentumTensor& t, int64_t begin, int64_t end);    // [Storage]: sum V^2
  void (*apply[2][kEfModes])(const ApplyTensor& t, int64_t begin, int64_t end);  // [Storage][EfMode]
  bool (*range_is_finite)(const float* x, int64_t begin, int64_t end);
};

namespace isa_baseline { extern const CpuLoops loops; }
#if ASYNCPP_HAS_ISA_VARIANTS
namespace isa_avx2 { extern const CpuLoops loops; }
namespace isa_avx512f { extern const CpuLoops loops; }
#endif

}  // namespace asyncpp::kernels::optim
