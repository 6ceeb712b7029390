// Multi-tensor CUDA optimizer kernels. One launch updates every tensor of the list: the host cuts
// the list into chunks of (tensor, begin, end), uploads the tensor descriptions and the chunk table
// to device memory on the caller's stream, and each block walks chunks in a grid-stride loop. The
// arithmetic is optim_math.h, the same functions the CPU kernels call, compiled without FMA
// contraction (--fmad=false, see CMakeLists.txt) so it rounds like the CPU build. The caller (the
// bindings' Python side) makes the tensors' device current.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "kernels/optim_kernels.h"

namespace asyncpp::kernels::optim {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// On failure the error is also cleared from the runtime's last-error slot, so a later, unrelated
// cudaGetLastError() (ours after a launch) is not blamed for it.
#define ASYNCPP_CUDA_OK(expr)                                                                   \
  do {                                                                                          \
    cudaError_t err_ = (expr);                                                                  \
    if (err_ != cudaSuccess) (void)cudaGetLastError();                                          \
    ASYNCPP_CHECK(err_ == cudaSuccess, "CUDA call ", #expr, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// A pinned host buffer a table is written to before its upload. From pageable memory the copy
// may wait for the stream's earlier work (the CUDA runtime stages it through pinned memory of its
// own): the host would stop at every table until the GPU caught up with it -- at a step's end,
// until the step's queued microbatches were done -- and the GPU would then idle while the host
// prepared the next launch. From pinned memory the copy is queued and the host goes on. Event
// `copied` (recorded after the copy) says when the buffer may be written again.
struct Staging {
  void* ptr = nullptr;
  size_t capacity = 0;
  cudaEvent_t copied = nullptr;
};

// One device buffer per GPU for the kernels' tables, kept for the life of the process and grown
// when a call needs more. Allocating per call would take memory from the CUDA runtime while
// torch's caching allocator may hold nearly all of it (and torch only frees its cache for its own
// allocations). Reuse is ordered: a call's upload waits for the previous call's kernels (event
// `done`, recorded on the previous call's stream) before overwriting the table, and `mu` keeps
// host threads from interleaving their uploads. The tables come from a ring of staging buffers: a
// buffer is written again kStaging uploads later, by when its last copy has long run (a step makes
// a few uploads), so the host waits for it only if it is that far ahead of the GPU.
struct Arena {
  static constexpr int kStaging = 8;
  std::mutex mu;
  void* ptr = nullptr;
  size_t capacity = 0;
  cudaEvent_t done = nullptr;
  Staging staging[kStaging];
  int next_staging = 0;
};

Arena& arena_of_current_device() {
  static std::mutex registry_mu;
  static std::map<int, std::unique_ptr<Arena>> arenas;  // device memory never freed: at exit the runtime may be gone
  int device = 0;
  ASYNCPP_CUDA_OK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& slot = arenas[device];
  if (!slot) slot = std::make_unique<Arena>();
  return *slot;
}

// Tensor descriptions, the chunk table and the index of each tensor's first chunk (chunks of one
// tensor are contiguous), uploaded to the current device's arena on the caller's stream, plus
// device scratch of `scratch_per_chunk` bytes per chunk and `scratch_per_tensor` per tensor (the
// momentum kernel's per-chunk partial sums; first_nonfinite's flags). Holds the arena from
// construction until destruction, which marks the arena free once this call's kernels are done.
template <typename Entry>
struct DeviceTable {
  Entry* entries = nullptr;
  Chunk* chunks = nullptr;
  int64_t* first_chunk = nullptr;  // [n_tensors + 1]
  void* scratch = nullptr;
  int64_t n_chunks = 0;
  cudaStream_t stream = nullptr;

  DeviceTable(const std::vector<Entry>& host_entries, cudaStream_t s, size_t scratch_per_chunk = 0,
              size_t scratch_per_tensor = 0)
      : stream(s), arena_(arena_of_current_device()), lock_(arena_.mu) {
    std::vector<Chunk> host_chunks;
    std::vector<int64_t> host_first(host_entries.size() + 1, 0);
    for (size_t t = 0; t < host_entries.size(); ++t) {
      host_first[t] = int64_t(host_chunks.size());
      const int64_t n = host_entries[t].numel;
      for (int64_t b = 0; b < n; b += kChunk) host_chunks.push_back({int64_t(t), b, std::min(n, b + kChunk)});
    }
    host_first.back() = int64_t(host_chunks.size());
    n_chunks = int64_t(host_chunks.size());
    if (host_entries.empty()) return;
    const size_t entry_bytes = host_entries.size() * sizeof(Entry);
    const size_t chunk_offset = align_up(entry_bytes, alignof(Chunk));
    const size_t first_offset = align_up(chunk_offset + host_chunks.size() * sizeof(Chunk), alignof(int64_t));
    const size_t upload = first_offset + host_first.size() * sizeof(int64_t);
    const size_t scratch_offset = align_up(upload, 16);
    const size_t total = scratch_offset + size_t(n_chunks) * scratch_per_chunk +
                         host_entries.size() * scratch_per_tensor;
    if (arena_.done == nullptr) ASYNCPP_CUDA_OK(cudaEventCreateWithFlags(&arena_.done, cudaEventDisableTiming));
    Staging& staging = arena_.staging[arena_.next_staging];
    arena_.next_staging = (arena_.next_staging + 1) % Arena::kStaging;
    if (staging.copied == nullptr) {
      ASYNCPP_CUDA_OK(cudaEventCreateWithFlags(&staging.copied, cudaEventDisableTiming));
    } else {
      ASYNCPP_CUDA_OK(cudaEventSynchronize(staging.copied));  // its last copy has left it
    }
    if (staging.capacity < upload) {
      if (staging.ptr != nullptr) ASYNCPP_CUDA_OK(cudaFreeHost(staging.ptr));
      staging.ptr = nullptr;
      staging.capacity = 0;
      const size_t grown = std::max(upload, size_t(64) << 10);
      ASYNCPP_CUDA_OK(cudaHostAlloc(&staging.ptr, grown, cudaHostAllocDefault));
      staging.capacity = grown;
    }
    auto* host = static_cast<unsigned char*>(staging.ptr);
    std::memcpy(host, host_entries.data(), entry_bytes);
    std::memcpy(host + chunk_offset, host_chunks.data(), host_chunks.size() * sizeof(Chunk));
    std::memcpy(host + first_offset, host_first.data(), host_first.size() * sizeof(int64_t));
    if (arena_.capacity < total) {
      ASYNCPP_CUDA_OK(cudaEventSynchronize(arena_.done));  // the old buffer's last readers are done
      if (arena_.ptr != nullptr) ASYNCPP_CUDA_OK(cudaFree(arena_.ptr));
      arena_.ptr = nullptr;
      arena_.capacity = 0;
      const size_t grown = std::max(total, size_t(64) << 10);
      ASYNCPP_CUDA_OK(cudaMalloc(&arena_.ptr, grown));
      arena_.capacity = grown;
    }
    ASYNCPP_CUDA_OK(cudaStreamWaitEvent(stream, arena_.done, 0));
    ASYNCPP_CUDA_OK(cudaMemcpyAsync(arena_.ptr, host, upload, cudaMemcpyHostToDevice, stream));
    ASYNCPP_CUDA_OK(cudaEventRecord(staging.copied, stream));
    auto* bytes = static_cast<unsigned char*>(arena_.ptr);
    entries = reinterpret_cast<Entry*>(bytes);
    chunks = reinterpret_cast<Chunk*>(bytes + chunk_offset);
    first_chunk = reinterpret_cast<int64_t*>(bytes + first_offset);
    scratch = (scratch_per_chunk || scratch_per_tensor) ? bytes + scratch_offset : nullptr;
    used_ = true;
  }
  ~DeviceTable() {
    // Everything this call queued on `stream` reads the arena; the next user waits for this.
    if (used_) (void)cudaEventRecord(arena_.done, stream);
  }
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;

  int blocks() const { return int(std::min<int64_t>(n_chunks, kMaxBlocks)); }

 private:
  Arena& arena_;
  std::unique_lock<std::mutex> lock_;
  bool used_ = false;
};

// A step skipped on the device: the scan before it found a NaN or Inf (nonfinite_flag_cuda).
__device__ __forceinline__ bool skipped(const int32_t* skip) { return skip != nullptr && *skip >= 0; }

__global__ void adamw_kernel(const AdamWTensor* tensors, const Chunk* chunks, int64_t n_chunks,
                             const int32_t* skip) {
  if (skipped(skip)) return;
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const AdamWTensor t = tensors[ch.tensor];
    for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += blockDim.x) {
      float m = t.exp_avg[i], v = t.exp_avg_sq[i];
      const float upd = adamw_direction(t.grad[i], m, v, t.s);
      t.exp_avg[i] = m;
      t.exp_avg_sq[i] = v;
      // W(t) from the source; the destination may be it or W(t-1), each read before this store.
      const float w = t.source[i];
      t.param[i] = apply_update_at(t.ef_mode, w, upd, t.neg_lr_wd, t.ef_beta, t.ef, t.previous, i);
    }
  }
}

__device__ float block_sum(float x) {
  __shared__ float warp_sums[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  float total = 0.0f;
  if (warp == 0) {
    total = lane < int(blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_down_sync(0xffffffffu, total, off);
  }
  __syncthreads();  // warp_sums is reused by the next chunk
  return total;     // valid in thread 0
}

// Each chunk's sum of squares goes to partial[chunk] (fixed order inside the block); the totals
// are then summed per tensor in chunk order (sum_partials), so the norm -- and everything Newton-
// Schulz computes from it -- is the same on every run and every data-parallel replica. Float
// atomics would add in arbitrary order.
template <Storage kOut>
__global__ void momentum_kernel(const MomentumTensor* tensors, const Chunk* chunks, int64_t n_chunks,
                                double* partial, const int32_t* skip) {
  if (skipped(skip)) return;  // (sum_partials then sums stale partials: what reads them is skipped too)
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const MomentumTensor t = tensors[ch.tensor];
    float local = 0.0f;
    for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += blockDim.x) {
      float b = t.buf[i];
      const float v = muon_momentum(t.grad[i], b, t.mu, t.nesterov);
      t.buf[i] = b;
      float stored;
      if constexpr (kOut == Storage::f32) {
        static_cast<float*>(t.out)[i] = v;
        stored = v;
      } else {
        const uint16_t bits = float_to_bf16(v);
        static_cast<uint16_t*>(t.out)[i] = bits;
        stored = bf16_to_float(bits);
      }
      local += stored * stored;
    }
    if (partial != nullptr) {
      const float total = block_sum(local);
      if (threadIdx.x == 0) partial[c] = double(total);
    }
  }
}

__global__ void sum_partials(const double* partial, const int64_t* first_chunk, int64_t n_tensors,
                             float* sumsq) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < n_tensors;
       t += int64_t(gridDim.x) * blockDim.x) {
    double s = 0.0;
    for (int64_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) s += partial[c];
    sumsq[t] = float(s);
  }
}

template <Storage kIn>
__global__ void apply_kernel(const ApplyTensor* tensors, const Chunk* chunks, int64_t n_chunks,
                             const int32_t* skip) {
  if (skipped(skip)) return;
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const ApplyTensor t = tensors[ch.tensor];
    for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += blockDim.x) {
      float o;
      if constexpr (kIn == Storage::f32) {
        o = static_cast<const float*>(t.update)[i];
      } else {
        o = bf16_to_float(static_cast<const uint16_t*>(t.update)[i]);
      }
      const float upd = t.update_scale * o;
      // W(t) from the source; the destination may be it or W(t-1), each read before this store.
      const float w = t.source[i];
      t.param[i] = apply_update_at(t.ef_mode, w, upd, t.neg_lr_wd, t.ef_beta, t.ef, t.previous, i);
    }
  }
}

// The accumulate kernel runs once per microbatch, so its tensor list travels as a kernel argument
// (batches of kAccumulateBatch, 2.3 KB, under the 4 KB argument limit) rather than through the
// arena's upload: no host-to-device copy of pageable memory, which may wait for the stream, and
// nothing to order between calls. Block row y walks tensor y of the batch.
constexpr int kAccumulateBatch = 96;
constexpr int kAccumulateBlocksX = 128;

struct AccumulateBatch {
  float* dst[kAccumulateBatch];
  const void* src[kAccumulateBatch];
  int64_t numel[kAccumulateBatch];
};

// Elements per 16-byte load of the source: the kernel is bound by memory, and 2- or 4-byte loads
// keep too few bytes in flight per thread to fill HBM (an H100 moved 2.5 TB/s of its ~3.35 with
// them). Two 16-byte accesses of dst per bf16 group, one per float32 group.
template <Storage kIn>
__host__ __device__ constexpr int accumulate_vec() { return kIn == Storage::f32 ? 4 : 8; }

// The first index from which dst and src both allow 16-byte accesses (the same element offset
// into each: views of flat buffers laid out alike), or n when none within one group does: then
// the whole tensor goes element by element.
template <Storage kIn>
__device__ __forceinline__ int64_t accumulate_peel(const float* dst, const void* src, int64_t n) {
  constexpr int kVec = accumulate_vec<kIn>();
  constexpr int64_t kSrcBytes = kIn == Storage::f32 ? 4 : 2;
  const uintptr_t s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  if (s % kSrcBytes != 0 || d % 4 != 0) return n;
  const int64_t peel = (kVec - int64_t(s / kSrcBytes) % kVec) % kVec;  // src 16-byte aligned there
  if ((d + uintptr_t(peel) * 4) % 16 != 0) return n;                   // dst is not, at the same index
  return peel < n ? peel : n;
}

template <Storage kIn>
__device__ __forceinline__ float accumulate_load(const void* src, int64_t i) {
  if constexpr (kIn == Storage::f32) {
    return static_cast<const float*>(src)[i];
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(src)[i]);
  }
}

// dst[i] += float(src[i]) for every i: the same sum per element whichever way it is loaded.
template <Storage kIn>
__global__ void accumulate_kernel(const AccumulateBatch batch) {
  constexpr int kVec = accumulate_vec<kIn>();
  float* dst = batch.dst[blockIdx.y];
  const void* src = batch.src[blockIdx.y];
  const int64_t n = batch.numel[blockIdx.y];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t peel = accumulate_peel<kIn>(dst, src, n);
  const int64_t groups = (n - peel) / kVec;
  for (int64_t i = first; i < peel; i += stride) dst[i] += accumulate_load<kIn>(src, i);
  for (int64_t g = first; g < groups; g += stride) {
    const int64_t at = peel + g * kVec;
    float4* out = reinterpret_cast<float4*>(dst + at);
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const char*>(src) + at * (kIn == Storage::f32 ? 4 : 2));
    if constexpr (kIn == Storage::f32) {
      float4 a = out[0];
      a.x += bits_float(raw.x);
      a.y += bits_float(raw.y);
      a.z += bits_float(raw.z);
      a.w += bits_float(raw.w);
      out[0] = a;
    } else {  // each 32-bit word holds two bf16: the lower-addressed one in its low half
      float4 a = out[0], b = out[1];
      a.x += bits_float(raw.x << 16);
      a.y += bits_float(raw.x & 0xffff0000u);
      a.z += bits_float(raw.y << 16);
      a.w += bits_float(raw.y & 0xffff0000u);
      b.x += bits_float(raw.z << 16);
      b.y += bits_float(raw.z & 0xffff0000u);
      b.z += bits_float(raw.w << 16);
      b.w += bits_float(raw.w & 0xffff0000u);
      out[0] = a;
      out[1] = b;
    }
  }
  for (int64_t i = peel + groups * kVec + first; i < n; i += stride) dst[i] += accumulate_load<kIn>(src, i);
}

__global__ void nonfinite_kernel(const ConstTensor* tensors, const Chunk* chunks, int64_t n_chunks,
                                 int* flags) {
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const float* x = tensors[ch.tensor].data;
    bool bad = false;
    for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += blockDim.x) bad |= !is_finite(x[i]);
    if (__syncthreads_or(bad) && threadIdx.x == 0) flags[ch.tensor] = 1;
  }
}

// flag <- the smallest index whose flag is set, or -1 (one block: the tensors of one step number
// hundreds; the scan over their elements is the work).
__global__ void first_flag_kernel(const int* flags, int n, int32_t* flag) {
  __shared__ int best;
  if (threadIdx.x == 0) best = n;
  __syncthreads();
  for (int t = threadIdx.x; t < n; t += blockDim.x)
    if (flags[t]) {
      atomicMin(&best, t);  // each thread's first set flag; the least of them is the answer
      break;
    }
  __syncthreads();
  if (threadIdx.x == 0) *flag = best < n ? best : -1;
}

cudaStream_t as_stream(intptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

void adamw_step_cuda(const std::vector<AdamWTensor>& tensors, const int32_t* skip, intptr_t stream) {
  DeviceTable<AdamWTensor> table(tensors, as_stream(stream));
  if (table.n_chunks == 0) return;
  adamw_kernel<<<table.blocks(), kThreads, 0, table.stream>>>(table.entries, table.chunks, table.n_chunks, skip);
  ASYNCPP_CUDA_OK(cudaGetLastError());
}

void muon_momentum_cuda(const std::vector<MomentumTensor>& tensors, Storage out_storage, float* sumsq,
                        const int32_t* skip, intptr_t stream) {
  DeviceTable<MomentumTensor> table(tensors, as_stream(stream), sumsq != nullptr ? sizeof(double) : 0);
  if (sumsq != nullptr && !tensors.empty())  // tensors without elements keep 0
    ASYNCPP_CUDA_OK(cudaMemsetAsync(sumsq, 0, tensors.size() * sizeof(float), table.stream));
  if (table.n_chunks == 0) return;
  auto* partial = static_cast<double*>(table.scratch);
  if (out_storage == Storage::f32) {
    momentum_kernel<Storage::f32><<<table.blocks(), kThreads, 0, table.stream>>>(
        table.entries, table.chunks, table.n_chunks, partial, skip);
  } else {
    momentum_kernel<Storage::bf16><<<table.blocks(), kThreads, 0, table.stream>>>(
        table.entries, table.chunks, table.n_chunks, partial, skip);
  }
  ASYNCPP_CUDA_OK(cudaGetLastError());
  if (sumsq == nullptr) return;
  const int64_t n = int64_t(tensors.size());
  const int blocks = int(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
  sum_partials<<<blocks, kThreads, 0, table.stream>>>(partial, table.first_chunk, n, sumsq);
  ASYNCPP_CUDA_OK(cudaGetLastError());
}

void apply_update_cuda(const std::vector<ApplyTensor>& tensors, Storage update_storage, const int32_t* skip,
                       intptr_t stream) {
  DeviceTable<ApplyTensor> table(tensors, as_stream(stream));
  if (table.n_chunks == 0) return;
  if (update_storage == Storage::f32) {
    apply_kernel<Storage::f32><<<table.blocks(), kThreads, 0, table.stream>>>(table.entries, table.chunks,
                                                                            table.n_chunks, skip);
  } else {
    apply_kernel<Storage::bf16><<<table.blocks(), kThreads, 0, table.stream>>>(table.entries, table.chunks,
                                                                             table.n_chunks, skip);
  }
  ASYNCPP_CUDA_OK(cudaGetLastError());
}

void accumulate_cuda(const std::vector<AccumulateTensor>& tensors, Storage src_storage, intptr_t stream) {
  static_assert(sizeof(AccumulateBatch) <= 4000, "kernel arguments are limited to 4 KB");
  for (size_t first = 0; first < tensors.size(); first += kAccumulateBatch) {
    const size_t count = std::min<size_t>(kAccumulateBatch, tensors.size() - first);
    AccumulateBatch batch{};
    int64_t largest = 0;
    for (size_t k = 0; k < count; ++k) {
      const AccumulateTensor& t = tensors[first + k];
      batch.dst[k] = t.dst;
      batch.src[k] = t.src;
      batch.numel[k] = t.numel;
      largest = std::max(largest, t.numel);
    }
    if (largest == 0) continue;
    const int64_t per_block = int64_t(kThreads) * (src_storage == Storage::f32 ? accumulate_vec<Storage::f32>()
                                                                                 : accumulate_vec<Storage::bf16>());
    const int64_t wanted = (largest + per_block - 1) / per_block;
    const dim3 grid(unsigned(std::min<int64_t>(wanted, kAccumulateBlocksX)), unsigned(count));
    if (src_storage == Storage::f32) {
      accumulate_kernel<Storage::f32><<<grid, kThreads, 0, as_stream(stream)>>>(batch);
    } else {
      accumulate_kernel<Storage::bf16><<<grid, kThreads, 0, as_stream(stream)>>>(batch);
    }
    ASYNCPP_CUDA_OK(cudaGetLastError());
  }
}

namespace {
// One flag per tensor (1: it holds a NaN or Inf) in the table's scratch, queued on its stream.
int* queue_nonfinite_flags(const DeviceTable<ConstTensor>& table, size_t n_tensors) {
  int* flags = static_cast<int*>(table.scratch);
  ASYNCPP_CUDA_OK(cudaMemsetAsync(flags, 0, n_tensors * sizeof(int), table.stream));
  if (table.n_chunks > 0) {
    nonfinite_kernel<<<table.blocks(), kThreads, 0, table.stream>>>(table.entries, table.chunks,
                                                                     table.n_chunks, flags);
    ASYNCPP_CUDA_OK(cudaGetLastError());
  }
  return flags;
}
}  // namespace

int64_t first_nonfinite_cuda(const std::vector<ConstTensor>& tensors, intptr_t stream) {
  if (tensors.empty()) return -1;
  DeviceTable<ConstTensor> table(tensors, as_stream(stream), 0, sizeof(int));
  const int* flags = queue_nonfinite_flags(table, tensors.size());
  std::vector<int> host(tensors.size(), 0);
  ASYNCPP_CUDA_OK(cudaMemcpyAsync(host.data(), flags, host.size() * sizeof(int), cudaMemcpyDeviceToHost,
                                  table.stream));
  ASYNCPP_CUDA_OK(cudaStreamSynchronize(table.stream));
  for (size_t t = 0; t < host.size(); ++t)
    if (host[t]) return int64_t(t);
  return -1;
}

void nonfinite_flag_cuda(const std::vector<ConstTensor>& tensors, int32_t* flag, intptr_t stream) {
  if (tensors.empty()) {
    first_flag_kernel<<<1, 32, 0, as_stream(stream)>>>(nullptr, 0, flag);
    ASYNCPP_CUDA_OK(cudaGetLastError());
    return;
  }
  DeviceTable<ConstTensor> table(tensors, as_stream(stream), 0, sizeof(int));
  const int* flags = queue_nonfinite_flags(table, tensors.size());
  first_flag_kernel<<<1, kThreads, 0, table.stream>>>(flags, int(tensors.size()), flag);
  ASYNCPP_CUDA_OK(cudaGetLastError());
}

}  // namespace asyncpp::kernels::optim
