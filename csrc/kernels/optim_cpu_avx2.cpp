// The CPU optimizer loops for AVX2: this unit alone is compiled with -mavx2 (CMakeLists.txt).
#include "kernels/optim_cpu_loops.h"
#if ASYNCPP_HAS_ISA_VARIANTS
#define ASYNCPP_ISA_NS isa_avx2
#include "kernels/optim_cpu_loops.inc"
#endif
