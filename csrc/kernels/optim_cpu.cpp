// Multi-tensor CPU optimizer kernels. The tensor list is cut into fixed-size chunks of
// (tensor, begin, end); the worker pool (cpu_pool.h, not an OpenMP region: see there why) spreads
// the chunks over threads, so many small tensors and a few large ones balance equally. The inner
// loops are straight-line calls into optim_math.h with the error-feedback mode hoisted into a
// template parameter, which lets the compiler vectorize them; each is built for several ISAs
// (cpu_isa.h).
#include <algorithm>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/cpu_pool.h"
#include "kernels/optim_kernels.h"

namespace asyncpp::kernels::optim {
namespace {

// Large enough to amortise scheduling, small enough to balance ~1M-element tensors on a few cores.
constexpr int64_t kChunk = 1 << 15;
// Below this many chunks one thread finishes in well under a millisecond; waking a helper costs
// more than it saves.
constexpr int64_t kMinParallelChunks = 8;

struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

template <typename Numel>
std::vector<WorkItem> split_work(size_t n_tensors, Numel numel_of) {
  std::vector<WorkItem> items;
  for (size_t t = 0; t < n_tensors; ++t) {
    const int64_t n = numel_of(t);
    for (int64_t b = 0; b < n; b += kChunk) items.push_back({int64_t(t), b, std::min(n, b + kChunk)});
  }
  return items;
}

template <EfMode kMode>
ASYNCPP_ISA_CLONES void adamw_range(const AdamWTensor& t, int64_t begin, int64_t end) {
  float* __restrict p = t.param;
  const float* __restrict g = t.grad;
  float* __restrict m = t.exp_avg;
  float* __restrict v = t.exp_avg_sq;
  float* __restrict e = t.ef;
  const AdamWScalars s = t.s;
  const float neg_lr_wd = t.neg_lr_wd, beta = t.ef_beta;
  for (int64_t i = begin; i < end; ++i) {
    float mi = m[i], vi = v[i];
    const float upd = adamw_direction(g[i], mi, vi, s);
    m[i] = mi;
    v[i] = vi;
    if constexpr (kMode == EfMode::off) {
      p[i] = apply_update<kMode>(p[i], upd, neg_lr_wd, beta, nullptr);
    } else {
      p[i] = apply_update<kMode>(p[i], upd, neg_lr_wd, beta, e + i);
    }
  }
}

template <Storage kOut>
ASYNCPP_ISA_CLONES double momentum_range(const MomentumTensor& t, int64_t begin, int64_t end) {
  const float* __restrict g = t.grad;
  float* __restrict b = t.buf;
  const float mu = t.mu;
  const bool nesterov = t.nesterov;
  double sumsq = 0.0;
  if constexpr (kOut == Storage::f32) {
    float* __restrict out = static_cast<float*>(t.out);
#pragma omp simd reduction(+ : sumsq)
    for (int64_t i = begin; i < end; ++i) {
      float bi = b[i];
      const float vi = muon_momentum(g[i], bi, mu, nesterov);
      b[i] = bi;
      out[i] = vi;
      sumsq += double(vi) * double(vi);
    }
  } else {
    uint16_t* __restrict out = static_cast<uint16_t*>(t.out);
#pragma omp simd reduction(+ : sumsq)
    for (int64_t i = begin; i < end; ++i) {
      float bi = b[i];
      const uint16_t vi = float_to_bf16(muon_momentum(g[i], bi, mu, nesterov));
      b[i] = bi;
      out[i] = vi;
      const double stored = bf16_to_float(vi);
      sumsq += stored * stored;
    }
  }
  return sumsq;
}

template <EfMode kMode, Storage kIn>
ASYNCPP_ISA_CLONES void apply_range(const ApplyTensor& t, int64_t begin, int64_t end) {
  float* __restrict p = t.param;
  float* __restrict e = t.ef;
  const float scale = t.update_scale, neg_lr_wd = t.neg_lr_wd, beta = t.ef_beta;
  for (int64_t i = begin; i < end; ++i) {
    float o;
    if constexpr (kIn == Storage::f32) {
      o = static_cast<const float*>(t.update)[i];
    } else {
      o = bf16_to_float(static_cast<const uint16_t*>(t.update)[i]);
    }
    const float upd = scale * o;
    if constexpr (kMode == EfMode::off) {
      p[i] = apply_update<kMode>(p[i], upd, neg_lr_wd, beta, nullptr);
    } else {
      p[i] = apply_update<kMode>(p[i], upd, neg_lr_wd, beta, e + i);
    }
  }
}

template <Storage kIn>
void apply_dispatch(const ApplyTensor& t, int64_t begin, int64_t end) {
  switch (t.ef_mode) {
    case EfMode::off: return apply_range<EfMode::off, kIn>(t, begin, end);
    case EfMode::first: return apply_range<EfMode::first, kIn>(t, begin, end);
    case EfMode::corrected: return apply_range<EfMode::corrected, kIn>(t, begin, end);
  }
}

ASYNCPP_ISA_CLONES bool range_is_finite(const float* x, int64_t begin, int64_t end) {
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = begin; i < end; ++i) bad |= is_finite(x[i]) ? 0u : 1u;
  return bad == 0;
}

}  // namespace

void adamw_step_cpu(const std::vector<AdamWTensor>& tensors) {
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  const int64_t n_items = int64_t(items.size());
  parallel_items(n_items, kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    const AdamWTensor& t = tensors[w.tensor];
    switch (t.ef_mode) {
      case EfMode::off: adamw_range<EfMode::off>(t, w.begin, w.end); break;
      case EfMode::first: adamw_range<EfMode::first>(t, w.begin, w.end); break;
      case EfMode::corrected: adamw_range<EfMode::corrected>(t, w.begin, w.end); break;
    }
  });
}

void muon_momentum_cpu(const std::vector<MomentumTensor>& tensors, Storage out_storage, float* sumsq) {
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  const int64_t n_items = int64_t(items.size());
  std::vector<double> partial(items.size(), 0.0);
  parallel_items(n_items, kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    partial[k] = out_storage == Storage::f32
                     ? momentum_range<Storage::f32>(tensors[w.tensor], w.begin, w.end)
                     : momentum_range<Storage::bf16>(tensors[w.tensor], w.begin, w.end);
  });
  if (sumsq == nullptr) return;
  // Reduce the chunk partials in a fixed order: the norm is deterministic for any thread count.
  std::vector<double> total(tensors.size(), 0.0);
  for (size_t k = 0; k < items.size(); ++k) total[items[k].tensor] += partial[k];
  for (size_t t = 0; t < tensors.size(); ++t) sumsq[t] = float(total[t]);
}

void apply_update_cpu(const std::vector<ApplyTensor>& tensors, Storage update_storage) {
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  const int64_t n_items = int64_t(items.size());
  parallel_items(n_items, kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    if (update_storage == Storage::f32) {
      apply_dispatch<Storage::f32>(tensors[w.tensor], w.begin, w.end);
    } else {
      apply_dispatch<Storage::bf16>(tensors[w.tensor], w.begin, w.end);
    }
  });
}

int64_t first_nonfinite_cpu(const std::vector<ConstTensor>& tensors) {
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  const int64_t n_items = int64_t(items.size());
  std::vector<unsigned char> bad(items.size(), 0);
  parallel_items(n_items, kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    bad[k] = range_is_finite(tensors[w.tensor].data, w.begin, w.end) ? 0 : 1;
  });
  for (size_t k = 0; k < items.size(); ++k)
    if (bad[k]) return items[k].tensor;
  return -1;
}

}  // namespace asyncpp::kernels::optim
