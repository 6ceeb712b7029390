// The NCCL transport tested on one GPU: a 1-rank communicator sends to itself (ncclSend and
// ncclRecv to peer 0 inside one NCCL group) through the transport's own ordering sequence
// (nccl_ordering.h). Per case: a producer kernel writes a byte pattern into the send buffer on the
// compute stream right before the send is posted; the receive buffer starts as a sentinel; after
// the transfer a checker kernel on a separate consumer stream, ordered only by the transfer's
// completion event, counts the bytes that differ from the pattern. One extra case delays the
// producer by `spin_ms` on the GPU, so a transfer that did not wait for the compute stream, or a
// consumer that did not wait for the transfer, would see sentinels and count mismatches.
// CUDA-free header; self_test exists only in CUDA builds.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace asyncpp::nccl {

struct SelfTestCase {
  std::string dtype;   // a label: the transport moves bytes, so a dtype is its element size
  int element_size;    // bytes per element: 1, 2, 4 or 8
  int64_t count;       // elements
};

struct SelfTestOutcome {
  SelfTestCase what;
  int64_t bytes = 0;
  int64_t mismatches = 0;  // received bytes that differ from what was sent
  double seconds = 0;      // host wall time of post + completion (after the producer finished)
};

struct SelfTestReport {
  int device = -1;
  std::vector<SelfTestOutcome> cases;
  SelfTestOutcome ordering;  // the delayed-producer case
  double spin_ms = 0;
};

#ifdef ASYNCPP_WITH_CUDA
// Runs every case on CUDA device `device`; NCCL must be loaded. Throws asyncpp::Error on a CUDA or
// NCCL failure (file:line and the failing call). Mismatches are reported, not thrown.
SelfTestReport self_test(int device, const std::vector<SelfTestCase>& cases, double spin_ms);
#endif

}  // namespace asyncpp::nccl
