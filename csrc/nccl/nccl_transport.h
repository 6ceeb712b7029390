// The CUDA transport: boundary messages move over NCCL point-to-point, one 2-rank communicator per
// link AND direction (activations s -> s+1, gradients s+1 -> s). On every communicator one rank
// only sends and the other only receives, in the same order, so no interleaving of sends and
// receives can deadlock. Each communicator has its own non-blocking CUDA stream; events order
// the transfers against the compute stream, so compute never waits for a send.
//
// This header is CUDA-free (handles are opaque) so bindings can include it in every build; the
// implementation exists only when CUDA is compiled in (ASYNCPP_WITH_CUDA).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor_view.h"
#include "core/transport.h"
#include "nccl/nccl_api.h"

namespace asyncpp::nccl {

using core::Buffer;
using core::BufferProvider;

// One communicator of this rank: which messages it carries and this rank's role on it.
struct ChannelSpec {
  core::MessageKind kind;
  bool is_send;       // this rank is the sender (NCCL rank 0) or the receiver (NCCL rank 1)
  int32_t peer;       // the other stage
  int32_t peer_rank;  // the other stage's process rank, for error messages
  UniqueId id;        // created by the sender, shared through the rendezvous store
};

// Checks a channel list for `stage` of a pipeline: activations go to stage+1 and come from
// stage-1, gradients go to stage-1 and come from stage+1, each (kind, direction) at most once.
// An empty list is valid (a single-stage pipeline moves no messages).
// Throws asyncpp::ArgumentError naming the bad entry. Usable without CUDA.
void validate_channels(int stage, const std::vector<ChannelSpec>& channels);

// A new NCCL unique id (ncclGetUniqueId). NCCL must be loaded (nccl::load).
UniqueId new_unique_id();

class NcclTransport final : public core::Transport {
 public:
  // Creates one communicator per channel (blocking until each peer has joined), on CUDA device
  // `device`. `compute_stream` (a cudaStream_t, 0 = legacy default) is the stream that produces
  // send payloads and consumes received ones. `buffers` must outlive the transport.
  NcclTransport(int stage, int device, std::uintptr_t compute_stream, std::vector<ChannelSpec> channels,
                BufferProvider& buffers);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  Request post_send(const core::MessageKey& key) override;
  Request post_recv(const core::MessageKey& key) override;
  bool test(Request request) override;
  void wait(Request request, double timeout_s) override;

  // Requests posted and not yet retired by test()/wait().
  size_t pending() const { return pending_.size(); }
  // What each of them is ("send of activation step 3 microbatch 1 (rank 2, 65536 bytes)"). Safe to
  // call from another thread while the executor runs: the watchdog's stall report reads it.
  std::vector<std::string> pending_descriptions() const;
  // Ends the run from another thread: the executor's wait in progress (within ~50 us) and every
  // later call fail with `reason`, on the executor's own thread, which aborts the communicators
  // (this transport is otherwise used by that one thread). Thread-safe; the first reason is kept.
  void cancel(const std::string& reason);
  // Tears the communicators down: waits for in-flight transfers (up to `timeout_s`), then destroys
  // them; aborts instead if any transfer is still incomplete. Idempotent.
  void close(double timeout_s = 30.0);

 private:
  struct Channel {
    ChannelSpec spec;
    Comm comm = nullptr;
    void* stream = nullptr;  // cudaStream_t
  };
  struct Pending {
    core::MessageKey key;
    bool is_send;
    size_t channel;
    void* done = nullptr;    // cudaEvent_t recorded after the transfer on the channel's stream
    std::shared_ptr<void> keep_alive;
  };

  Request post(const core::MessageKey& key, bool is_send);
  size_t channel_for(const core::MessageKey& key, bool is_send) const;
  // cudaSuccess -> true, not ready -> false; CUDA or NCCL async errors abort and throw.
  bool poll(const Pending& p);
  void retire(Request request);
  [[noreturn]] void fail(const std::string& what);
  void abort_all();
  void check_usable();  // throws the failure, or fails now if cancelled

  int stage_;
  int device_;
  void* compute_stream_;  // cudaStream_t
  BufferProvider& buffers_;
  std::vector<Channel> channels_;
  std::unordered_map<Request, Pending> pending_;
  mutable std::mutex described_mu_;        // guards described_ (read by the watchdog thread)
  std::map<Request, std::string> described_;  // mirrors pending_'s keys
  Request next_request_ = 0;
  std::string failure_;  // set once aborted: every later call reports it
  bool closed_ = false;
  std::atomic<bool> cancelled_{false};  // set by cancel() from another thread
  std::string cancel_reason_;          // guarded by described_mu_
};

}  // namespace asyncpp::nccl
