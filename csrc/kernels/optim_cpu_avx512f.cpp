// The CPU optimizer loops for AVX-512F: this unit alone is compiled with -mavx512f (CMakeLists.txt).
#include "kernels/optim_cpu_loops.h"
#if ASYNCPP_HAS_ISA_VARIANTS
#define ASYNCPP_ISA_NS isa_avx512f
#include "kernels/optim_cpu_loops.inc"
#endif
