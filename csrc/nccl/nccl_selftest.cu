// See nccl_selftest.h.
#include "nccl/nccl_selftest.h"

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "core/error.h"
#include "nccl/nccl_check.h"
#include "nccl/nccl_ordering.h"

namespace asyncpp::nccl {
namespace {

constexpr unsigned char kSendSentinel = 0xA5, kRecvSentinel = 0x5A;

// A byte per index that covers all 256 values (and so NaN/denormal/negative-zero bit patterns of
// every float dtype) without repeating with any small period.
__host__ __device__ inline unsigned char pattern(uint64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA6Bu ^ seed * 0x9E3779B9u;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return static_cast<unsigned char>(x);
}

__device__ inline uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The producer: optionally busy-waits `spin_ns` (one thread, before any write), then writes.
__global__ void produce(unsigned char* out, uint64_t n, uint32_t seed, uint64_t spin_ns) {
  if (spin_ns) {
    if (threadIdx.x == 0) {
      const uint64_t start = global_ns();
      while (global_ns() - start < spin_ns) {
      }
    }
    __syncthreads();
  }
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    out[i] = pattern(i, seed);
}

__global__ void count_mismatches(const unsigned char* in, uint64_t n, uint32_t seed, unsigned long long* bad) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    local += in[i] != pattern(i, seed);
  if (local) atomicAdd(bad, local);
}

unsigned grid_for(uint64_t n) { return static_cast<unsigned>(n / 256 + 1 < 1024 ? n / 256 + 1 : 1024); }

// Everything one run owns, released on every exit path.
struct Resources {
  Comm comm = nullptr;
  cudaStream_t compute = nullptr, transfer = nullptr, consumer = nullptr;
  unsigned char *send = nullptr, *recv = nullptr;
  unsigned long long* bad = nullptr;
  ~Resources() {
    if (comm) api().ncclCommDestroy(comm);
    for (cudaStream_t s : {compute, transfer, consumer})
      if (s) cudaStreamDestroy(s);
    for (void* p : {static_cast<void*>(send), static_cast<void*>(recv), static_cast<void*>(bad)})
      if (p) cudaFree(p);
  }
};

SelfTestOutcome run_case(Resources& r, const SelfTestCase& c, uint32_t seed, uint64_t spin_ns) {
  const Api& nccl = api();
  SelfTestOutcome out{c, c.count * c.element_size, 0, 0};
  const uint64_t n = static_cast<uint64_t>(out.bytes);
  ASYNCPP_CUDA_CHECK(cudaMemsetAsync(r.send, kSendSentinel, n, r.compute));
  ASYNCPP_CUDA_CHECK(cudaMemsetAsync(r.recv, kRecvSentinel, n, r.compute));
  ASYNCPP_CUDA_CHECK(cudaMemsetAsync(r.bad, 0, sizeof(*r.bad), r.compute));
  ASYNCPP_CUDA_CHECK(cudaStreamSynchronize(r.compute));
  // Producer right before the send, on the compute stream; the host does not wait for it.
  produce<<<grid_for(n), 256, 0, r.compute>>>(r.send, n, seed, spin_ns);
  ASYNCPP_CUDA_CHECK(cudaGetLastError());
  const auto start = std::chrono::steady_clock::now();
  wait_for_compute(r.compute, r.transfer);
  ASYNCPP_NCCL_CHECK(nccl.ncclGroupStart());
  enqueue_transfer(nccl, true, r.send, n, 0, r.comm, r.transfer);
  enqueue_transfer(nccl, false, r.recv, n, 0, r.comm, r.transfer);
  ASYNCPP_NCCL_CHECK(nccl.ncclGroupEnd());
  OwnedEvent done{record_done(r.transfer)};
  // The consumer reads the received bytes ordered by the completion event alone.
  order_after(r.consumer, done.event);
  count_mismatches<<<grid_for(n), 256, 0, r.consumer>>>(r.recv, n, seed, r.bad);
  ASYNCPP_CUDA_CHECK(cudaGetLastError());
  ASYNCPP_CUDA_CHECK(cudaEventSynchronize(done.event));
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  unsigned long long bad = 0;
  ASYNCPP_CUDA_CHECK(cudaMemcpyAsync(&bad, r.bad, sizeof(bad), cudaMemcpyDeviceToHost, r.consumer));
  ASYNCPP_CUDA_CHECK(cudaStreamSynchronize(r.consumer));
  out.mismatches = static_cast<int64_t>(bad);
  return out;
}

}  // namespace

SelfTestReport self_test(int device, const std::vector<SelfTestCase>& cases, double spin_ms) {
  const Api& nccl = api();  // throws with install advice when NCCL is not loaded
  int previous = -1;
  ASYNCPP_CUDA_CHECK(cudaGetDevice(&previous));
  ASYNCPP_CUDA_CHECK(cudaSetDevice(device));
  struct Restore {
    int device;
    ~Restore() { cudaSetDevice(device); }
  } restore{previous};

  SelfTestReport report;
  report.device = device;
  report.spin_ms = spin_ms;
  uint64_t largest = 1;
  for (const SelfTestCase& c : cases) largest = std::max<uint64_t>(largest, c.count * c.element_size);
  Resources r;
  ASYNCPP_CUDA_CHECK(cudaStreamCreateWithFlags(&r.compute, cudaStreamNonBlocking));
  ASYNCPP_CUDA_CHECK(cudaStreamCreateWithFlags(&r.transfer, cudaStreamNonBlocking));
  ASYNCPP_CUDA_CHECK(cudaStreamCreateWithFlags(&r.consumer, cudaStreamNonBlocking));
  ASYNCPP_CUDA_CHECK(cudaMalloc(&r.send, largest));
  ASYNCPP_CUDA_CHECK(cudaMalloc(&r.recv, largest));
  ASYNCPP_CUDA_CHECK(cudaMalloc(&r.bad, sizeof(*r.bad)));
  UniqueId id;
  ASYNCPP_NCCL_CHECK(nccl.ncclGetUniqueId(&id));
  ASYNCPP_NCCL_CHECK(nccl.ncclCommInitRank(&r.comm, 1, id, 0));

  uint32_t seed = 1;
  for (const SelfTestCase& c : cases) report.cases.push_back(run_case(r, c, seed++, 0));
  // The ordering case: the largest transfer behind a producer delayed on the GPU.
  const SelfTestCase* biggest = &cases.front();
  for (const SelfTestCase& c : cases)
    if (c.count * c.element_size > biggest->count * biggest->element_size) biggest = &c;
  report.ordering = run_case(r, *biggest, seed, static_cast<uint64_t>(spin_ms * 1e6));
  return report;
}

}  // namespace asyncpp::nccl
