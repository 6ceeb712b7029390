// How a transfer is ordered against the streams around it, shared by NcclTransport and the
// one-GPU self-test so that the test exercises the transport's own sequence:
//   wait_for_compute  the transfer's stream waits for the work queued so far on the compute stream
//                     (a send's payload is produced there);
//   enqueue_transfer  the payload moves as raw bytes (ncclUint8): every dtype is bit-exact;
//   record_done       an event after the transfer on its stream;
//   order_after       a consumer stream waits for that event before reading a received buffer.
// Inside an NCCL group, record_done must follow ncclGroupEnd (the kernels are enqueued there).
#pragma once
#ifdef ASYNCPP_WITH_CUDA
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "nccl/nccl_check.h"

namespace asyncpp::nccl {

// Destroys an event on scope exit unless released; CUDA frees it once pending waits are satisfied.
struct OwnedEvent {
  cudaEvent_t event = nullptr;
  ~OwnedEvent() {
    if (event) cudaEventDestroy(event);
  }
  cudaEvent_t release() { return std::exchange(event, nullptr); }
};

inline void wait_for_compute(cudaStream_t compute, cudaStream_t transfer) {
  OwnedEvent ready;
  ASYNCPP_CUDA_CHECK(cudaEventCreateWithFlags(&ready.event, cudaEventDisableTiming));
  ASYNCPP_CUDA_CHECK(cudaEventRecord(ready.event, compute));
  ASYNCPP_CUDA_CHECK(cudaStreamWaitEvent(transfer, ready.event, 0));
}

inline void enqueue_transfer(const Api& api, bool is_send, void* data, size_t bytes, int peer, Comm comm,
                             cudaStream_t transfer) {
  if (is_send)
    ASYNCPP_NCCL_CHECK(api.ncclSend(data, bytes, kUint8, peer, comm, transfer));
  else
    ASYNCPP_NCCL_CHECK(api.ncclRecv(data, bytes, kUint8, peer, comm, transfer));
}

inline cudaEvent_t record_done(cudaStream_t transfer) {
  OwnedEvent done;
  ASYNCPP_CUDA_CHECK(cudaEventCreateWithFlags(&done.event, cudaEventDisableTiming));
  ASYNCPP_CUDA_CHECK(cudaEventRecord(done.event, transfer));
  return done.release();
}

inline void order_after(cudaStream_t consumer, cudaEvent_t done) {
  ASYNCPP_CUDA_CHECK(cudaStreamWaitEvent(consumer, done, 0));
}

}  // namespace asyncpp::nccl
#endif  // ASYNCPP_WITH_CUDA
