// Per-element optimizer math shared by the CPU (optim_cpu.cpp) and CUDA (optim_cuda.cu) kernels,
// so the CPU tests check the very arithmetic the GPU runs. Everything is float32: parameters,
// gradients and optimizer state. The only other storage type is bfloat16 for the Muon
// orthogonalisation input/output; a later bf16-weight path plugs in through load/store helpers
// (`load_as_float`, `store_from_float`) without touching the update formulas.
#pragma once
#include <cstdint>
#include <cstring>
#include <math.h>

#ifdef __CUDACC__
#define ASYNCPP_HD __host__ __device__ __forceinline__
#else
#define ASYNCPP_HD inline
#endif

namespace asyncpp::kernels::optim {

// Error-feedback state of one tensor for one step:
//   off       -> plain update, E is neither read nor written (beta == 0 allocates no buffer)
//   first     -> plain update, E <- D (no history yet)
//   corrected -> W <- W + D + beta*(D - E), E <- D
//   weights   -> W <- W + D + beta*(D - E) with E = W(t) - W(t-1), the update applied at the last
//                step, read from the previous weight version: no buffer is read or written
enum class EfMode : int { off = 0, first = 1, corrected = 2, weights = 3 };
constexpr int kEfModes = 4;

// ---- storage conversions ----------------------------------------------------------------------
ASYNCPP_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

ASYNCPP_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// float32 -> bfloat16 bits, round to nearest even (torch's rounding); NaN stays a quiet NaN.
// Written as a select, not an early return, so the CPU loops that call it vectorize.
ASYNCPP_HD uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t nan = (u >> 16) | 0x0040u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

ASYNCPP_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Branch-free finiteness test on the bit pattern: immune to -ffast-math and vectorizes.
ASYNCPP_HD bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

// ---- AdamW (mirrors torch.optim.AdamW's single-tensor arithmetic, op for op) --------------------
struct AdamWScalars {
  float beta1_weight;   // 1 - beta1 (lerp weight of the first moment)
  float beta2;
  float one_minus_beta2;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
};

// Updates the moments in place; returns the Adam part of D (without weight decay).
ASYNCPP_HD float adamw_direction(float g, float& m, float& v, const AdamWScalars& s) {
  m = m + s.beta1_weight * (g - m);
  v = v * s.beta2 + s.one_minus_beta2 * g * g;  // addcmul: (value*t1)*t2
  const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
  return s.neg_step_size * m / denom;  // addcdiv: (value*t1)/t2
}

// ---- Muon momentum ----------------------------------------------------------------------------
// B <- mu*B + (1-mu)*G ; returns V = (1-mu)*G + mu*B (nesterov) or B.
ASYNCPP_HD float muon_momentum(float g, float& b, float mu, bool nesterov) {
  const float one_minus_mu = 1.0f - mu;
  b = mu * b + one_minus_mu * g;
  return nesterov ? one_minus_mu * g + mu * b : b;
}

// ---- the final weight update, with optional error feedback --------------------------------------
// `w` is W(t), `upd` the optimizer's step without weight decay and neg_lr_wd = -lr*wd; the result
// is W(t+1). The update D = W*neg_lr_wd + upd is always formed explicitly and added once,
// W <- W + D: more exact than torch's W*(1 - lr*wd) + upd, whose float32 decay factor is off by up
// to 6e-8 relative (a drift of ~1e-5 of the step size over 10 steps at lr*wd = 2e-3). EF sees the
// exact D, not a difference of rounded weights. kMode == off and kMode == first produce bitwise the
// same W. `e` points at this element of the EF buffer (first, corrected) and `w_prev` at this
// element of W(t-1) (weights); both are read before the caller stores the result, so the caller's
// destination may be the very storage of W(t) or of W(t-1).
template <EfMode kMode>
ASYNCPP_HD float apply_update(float w, float upd, float neg_lr_wd, float beta, float* e,
                              const float* w_prev) {
  const float d = w * neg_lr_wd + upd;
  if constexpr (kMode == EfMode::off) {
    (void)beta;
    (void)e;
    (void)w_prev;
    return w + d;
  } else if constexpr (kMode == EfMode::first) {
    (void)beta;
    (void)w_prev;
    *e = d;
    return w + d;
  } else if constexpr (kMode == EfMode::corrected) {
    (void)w_prev;
    const float out = w + (d + beta * (d - *e));
    *e = d;
    return out;
  } else {
    (void)e;
    const float applied = w - *w_prev;  // E: what the last step added to the weights
    return w + (d + beta * (d - applied));
  }
}

// The same with the mode chosen at run time (per tensor, as the CUDA kernels read it from their
// tensor table). `e` is the EF buffer's base, `w_prev` W(t-1)'s; each is touched only in its modes.
ASYNCPP_HD float apply_update_at(EfMode mode, float w, float upd, float neg_lr_wd, float beta,
                                 float* e, const float* w_prev, int64_t i) {
  switch (mode) {
    case EfMode::first: return apply_update<EfMode::first>(w, upd, neg_lr_wd, beta, e + i, nullptr);
    case EfMode::corrected:
      return apply_update<EfMode::corrected>(w, upd, neg_lr_wd, beta, e + i, nullptr);
    case EfMode::weights:
      return apply_update<EfMode::weights>(w, upd, neg_lr_wd, beta, nullptr, w_prev + i);
    default: return apply_update<EfMode::off>(w, upd, neg_lr_wd, beta, nullptr, nullptr);
  }
}

}  // namespace asyncpp::kernels::optim
