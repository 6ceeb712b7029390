// Which instruction set the CPU optimizer loops run with. The package is built for the baseline
// ISA of the target (x86-64: SSE2) so it runs anywhere; on x86-64 with GCC or Clang the loops are
// also compiled for AVX2 and AVX-512 (one translation unit each, optim_cpu_loops.h), and one of
// them is chosen once per process: $ASYNCPP_CPU_ISA = auto | baseline | avx2 | avx512 (avx512f),
// case-insensitive, unset or empty = auto = the best built ISA this CPU supports. Every variant is
// compiled with -ffp-contract=off, so each rounds exactly like the baseline. Build with
// CXXFLAGS=-DASYNCPP_NO_ISA_CLONES for the baseline only.
#pragma once
#include <string>
#include <vector>

namespace asyncpp::kernels {

enum class CpuIsa : int { baseline = 0, avx2 = 1, avx512f = 2 };

// "baseline", "avx2", "avx512f": the names build_info reports.
const char* cpu_isa_name(CpuIsa isa);

struct CpuIsaSelection {
  bool ok = false;
  CpuIsa isa = CpuIsa::baseline;  // valid when ok
  std::string reason;             // when ok: why this ISA ("forced by ASYNCPP_CPU_ISA=avx2")
  std::string error;              // when not ok: the one message the kernels raise
  std::vector<CpuIsa> built;      // compiled into this build, baseline first
  std::vector<CpuIsa> runnable;   // built and supported by this CPU
};

// Reads $ASYNCPP_CPU_ISA and the CPU on the first call; later calls return the same answer, so a
// process never switches ISA. Never throws: an invalid setting is reported in `error`.
const CpuIsaSelection& cpu_isa_selection();

// The ISA the CPU kernels run with; throws asyncpp::ArgumentError (ValueError) carrying
// cpu_isa_selection().error when the setting cannot be honoured.
CpuIsa cpu_kernel_isa();

}  // namespace asyncpp::kernels
