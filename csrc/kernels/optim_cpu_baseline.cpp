// The CPU optimizer loops for the target's baseline ISA (x86-64: SSE2): what every CPU runs.
#define ASYNCPP_ISA_NS isa_baseline
#include "kernels/optim_cpu_loops.inc"
