// Multi-tensor CPU optimizer kernels. The tensor list is cut into fixed-size chunks of
// (tensor, begin, end); the worker pool (cpu_pool.h, not an OpenMP region: see there why) spreads
// the chunks over threads, so many small tensors and a few large ones balance equally. The inner
// loops themselves live in optim_cpu_loops.inc, compiled once per ISA; this file calls them through
// the table of the ISA chosen for the process (cpu_isa.h).
#include <algorithm>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/cpu_pool.h"
#include "kernels/optim_cpu_loops.h"
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

// The loops of the ISA chosen for this process; throws when $ASYNCPP_CPU_ISA cannot be honoured.
// Called on the caller's thread, before any work is handed to the pool.
const CpuLoops& cpu_loops() {
  switch (cpu_kernel_isa()) {
#if ASYNCPP_HAS_ISA_VARIANTS
    case CpuIsa::avx512f: return isa_avx512f::loops;
    case CpuIsa::avx2: return isa_avx2::loops;
#endif
    default: return isa_baseline::loops;
  }
}

}  // namespace

void adamw_step_cpu(const std::vector<AdamWTensor>& tensors) {
  const CpuLoops& loops = cpu_loops();
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  const int64_t n_items = int64_t(items.size());
  parallel_items(n_items, kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    const AdamWTensor& t = tensors[w.tensor];
    loops.adamw[int(t.ef_mode)](t, w.begin, w.end);
  });
}

void muon_momentum_cpu(const std::vector<MomentumTensor>& tensors, Storage out_storage, float* sumsq) {
  const auto momentum_range = cpu_loops().momentum[int(out_storage)];
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  const int64_t n_items = int64_t(items.size());
  std::vector<double> partial(items.size(), 0.0);
  parallel_items(n_items, kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    partial[k] = momentum_range(tensors[w.tensor], w.begin, w.end);
  });
  if (sumsq == nullptr) return;
  // Reduce the chunk partials in a fixed order: the norm is deterministic for any thread count.
  std::vector<double> total(tensors.size(), 0.0);
  for (size_t k = 0; k < items.size(); ++k) total[items[k].tensor] += partial[k];
  for (size_t t = 0; t < tensors.size(); ++t) sumsq[t] = float(total[t]);
}

void apply_update_cpu(const std::vector<ApplyTensor>& tensors, Storage update_storage) {
  const auto& apply_range = cpu_loops().apply[int(update_storage)];
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  const int64_t n_items = int64_t(items.size());
  parallel_items(n_items, kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    const ApplyTensor& t = tensors[w.tensor];
    apply_range[int(t.ef_mode)](t, w.begin, w.end);
  });
}

int64_t first_nonfinite_cpu(const std::vector<ConstTensor>& tensors) {
  const auto range_is_finite = cpu_loops().range_is_finite;
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

namespace {
template <Storage kIn>
void accumulate_range(const AccumulateTensor& t, int64_t begin, int64_t end) {
  float* dst = t.dst;
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (kIn == Storage::f32) {
      dst[i] += static_cast<const float*>(t.src)[i];
    } else {
      dst[i] += bf16_to_float(static_cast<const uint16_t*>(t.src)[i]);
    }
  }
}
}  // namespace

void accumulate_cpu(const std::vector<AccumulateTensor>& tensors, Storage src_storage) {
  const auto range = src_storage == Storage::f32 ? accumulate_range<Storage::f32> : accumulate_range<Storage::bf16>;
  const auto items = split_work(tensors.size(), [&](size_t t) { return tensors[t].numel; });
  parallel_items(int64_t(items.size()), kMinParallelChunks, [&](int64_t k) {
    const WorkItem& w = items[k];
    range(tensors[w.tensor], w.begin, w.end);
  });
}

}  // namespace asyncpp::kernels::optim
