// Multi-tensor optimizer kernels: one call updates a whole list of tensors. The bindings
// (optim_bindings.cpp) have already checked every pointer, dtype, device and size; these functions
// trust their input. CPU versions spread fixed-size chunks of the flattened tensor list over a
// worker pool (cpu_pool.h); CUDA versions take the same descriptions plus the stream to launch on.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/optim_math.h"

namespace asyncpp::kernels::optim {

// Storage type of a Muon orthogonalisation buffer (V written by the momentum kernel, O read by the
// apply kernel). Parameters, gradients and state are always float32.
enum class Storage : int { f32 = 0, bf16 = 1 };

// Out of place: `param` is the destination W(t+1) is written to and `source` holds W(t); in place
// they are the same pointer. `previous` (W(t-1), EfMode::weights only) may be the destination's
// storage too (2bw), never a partial overlap: every element is read before it is written.
struct AdamWTensor {
  float* param;
  const float* source;
  const float* previous;  // nullptr unless ef_mode == weights
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* ef;          // error-feedback buffer, nullptr unless ef_mode is first or corrected
  int64_t numel;
  AdamWScalars s;     // per tensor: the bias corrections depend on its own step count
  float neg_lr_wd;    // -lr*wd
  float ef_beta;
  EfMode ef_mode;
};

struct MomentumTensor {
  const float* grad;
  float* buf;
  void* out;          // V, in `Storage`
  int64_t numel;
  float mu;
  bool nesterov;
};

struct ApplyTensor {
  float* param;           // destination, source and previous as in AdamWTensor
  const float* source;
  const float* previous;
  const void* update;     // O, in `Storage`
  float* ef;
  int64_t numel;
  float update_scale;  // -adjusted_lr
  float neg_lr_wd;
  float ef_beta;
  EfMode ef_mode;
};

struct ConstTensor {
  const float* data;
  int64_t numel;
};

// dst += src, src in `Storage` widened exactly to float32 (a bf16 compute copy's gradient added into
// its float32 weight's gradient): the float32 sum torch's mixed add_ gives, rounded once.
struct AccumulateTensor {
  float* dst;
  const void* src;
  int64_t numel;
};

// ---- CPU --------------------------------------------------------------------------------------
void adamw_step_cpu(const std::vector<AdamWTensor>& tensors);
// Writes V for every tensor and, when sumsq != nullptr, sumsq[i] = sum of V_i^2 as stored
// (after rounding to `out_storage`), which is what the orthogonalisation normalises by.
void muon_momentum_cpu(const std::vector<MomentumTensor>& tensors, Storage out_storage, float* sumsq);
void apply_update_cpu(const std::vector<ApplyTensor>& tensors, Storage update_storage);
// Index of the first tensor holding a NaN or Inf, or -1.
int64_t first_nonfinite_cpu(const std::vector<ConstTensor>& tensors);
void accumulate_cpu(const std::vector<AccumulateTensor>& tensors, Storage src_storage);

#ifdef ASYNCPP_WITH_CUDA
// ---- CUDA (stream = cudaStream_t as an integer, 0 = legacy default stream) ---------------------
// `sumsq` is a device pointer to float[tensors.size()], written on `stream` in a fixed summation
// order (per-chunk partials, then summed per tensor in chunk order): the same on every run.
// `skip` (a device int32, or nullptr): when it holds a value >= 0 as the kernels run -- the index a
// nonfinite_flag_cuda call wrote, the first tensor holding a NaN or Inf -- they change nothing: the
// step is skipped on the device, without the host waiting for the scan.
void adamw_step_cuda(const std::vector<AdamWTensor>& tensors, const int32_t* skip, intptr_t stream);
void muon_momentum_cuda(const std::vector<MomentumTensor>& tensors, Storage out_storage, float* sumsq,
                        const int32_t* skip, intptr_t stream);
void apply_update_cuda(const std::vector<ApplyTensor>& tensors, Storage update_storage, const int32_t* skip,
                       intptr_t stream);
// Synchronises `stream` to read the answer back.
int64_t first_nonfinite_cuda(const std::vector<ConstTensor>& tensors, intptr_t stream);
// The same answer written to the device int32 `flag` on `stream` (-1: every value finite); no sync.
void nonfinite_flag_cuda(const std::vector<ConstTensor>& tensors, int32_t* flag, intptr_t stream);
void accumulate_cuda(const std::vector<AccumulateTensor>& tensors, Storage src_storage, intptr_t stream);
#endif

}  // namespace asyncpp::kernels::optim
