// NcclTransport (see nccl_transport.h). Compiled only with CUDA; without it the bindings report
// that the package must be rebuilt with nvcc available.
#ifdef ASYNCPP_WITH_CUDA
#include "nccl/nccl_transport.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "nccl/nccl_check.h"
#include "nccl/nccl_ordering.h"

namespace asyncpp::nccl {
namespace {

using Clock = std::chrono::steady_clock;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Makes `device` current for the calling thread (CUDA's current device is per thread, and the
// executor may run on a thread that never selected it) and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int current = -1;
    ASYNCPP_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) {
      ASYNCPP_CUDA_CHECK(cudaSetDevice(device));
      previous_ = current;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

const char* kind_name(core::MessageKind kind) {
  return kind == core::MessageKind::activation ? "activation" : "gradient";
}

// Every rank creates its communicators in this global order -- by link (the lower stage of the
// pair), then kind -- so two ranks never wait for each other on different communicators.
bool init_order(int stage, const ChannelSpec& a, const ChannelSpec& b) {
  const int link_a = std::min(stage, a.peer), link_b = std::min(stage, b.peer);
  if (link_a != link_b) return link_a < link_b;
  return static_cast<int>(a.kind) < static_cast<int>(b.kind);
}

}  // namespace

NcclTransport::NcclTransport(int stage, int device, std::uintptr_t compute_stream,
                             std::vector<ChannelSpec> channels, BufferProvider& buffers)
    : stage_(stage), device_(device), compute_stream_(reinterpret_cast<void*>(compute_stream)),
      buffers_(buffers) {
  validate_channels(stage, channels);
  ASYNCPP_ARG_CHECK(device >= 0, "device must be a CUDA device index >= 0 (got ", device, ")");
  const Api& nccl = api();  // throws with install advice when NCCL is not loaded
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) cudaGetLastError();
  ASYNCPP_CHECK(err == cudaSuccess && device < count, "stage ", stage, ": CUDA device ", device,
                " is not available (", count, " visible",
                err == cudaSuccess ? "" : std::string(", ") + cudaGetErrorString(err),
                "); the NCCL transport needs a GPU per stage -- use the gloo transport on CPU");

  std::sort(channels.begin(), channels.end(),
            [stage](const ChannelSpec& a, const ChannelSpec& b) { return init_order(stage, a, b); });
  DeviceGuard guard(device_);
  try {
    for (const ChannelSpec& spec : channels) {
      Channel ch{spec, nullptr, nullptr};
      cudaStream_t stream = nullptr;
      ASYNCPP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      ch.stream = stream;
      channels_.push_back(ch);
      // Sender is NCCL rank 0, receiver rank 1; blocks until the peer joins this communicator.
      try {
        ASYNCPP_NCCL_CHECK(nccl.ncclCommInitRank(&channels_.back().comm, 2, spec.id, spec.is_send ? 0 : 1));
      } catch (const Error& e) {
        throw Error(detail::concat("stage ", stage_, ": creating the ", kind_name(spec.kind), " ",
                                   spec.is_send ? "send" : "receive", " communicator with stage ", spec.peer,
                                   " (rank ", spec.peer_rank, ") failed: ", e.what()));
      }
    }
  } catch (...) {
    abort_all();
    for (Channel& ch : channels_)
      if (ch.stream) cudaStreamDestroy(as_stream(ch.stream));
    channels_.clear();
    throw;
  }
}

NcclTransport::~NcclTransport() {
  try {
    close();
  } catch (...) {  // a destructor must not throw; close() already aborted what it could not finish
  }
}

size_t NcclTransport::channel_for(const core::MessageKey& key, bool is_send) const {
  for (size_t i = 0; i < channels_.size(); ++i) {
    const ChannelSpec& s = channels_[i].spec;
    if (s.kind == key.kind && s.is_send == is_send && s.peer == key.peer) return i;
  }
  throw ArgumentError(detail::concat("stage ", stage_, " has no channel to ", core::describe(key, is_send),
                                     "; the transport was created with ", channels_.size(),
                                     " channel(s) -- give one per neighbour and direction"));
}

void NcclTransport::check_usable() {
  ASYNCPP_CHECK(failure_.empty(), "the NCCL transport of stage ", stage_,
                " was aborted after an earlier failure: ", failure_);
  ASYNCPP_CHECK(!closed_, "the NCCL transport of stage ", stage_, " is closed; create a new one");
  if (cancelled_.load(std::memory_order_acquire)) {
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(described_mu_);
      reason = cancel_reason_;
    }
    fail(detail::concat("stage ", stage_, ": NCCL transport: ", reason));
  }
}

void NcclTransport::cancel(const std::string& reason) {
  std::lock_guard<std::mutex> lock(described_mu_);
  if (cancelled_.load(std::memory_order_relaxed)) return;
  cancel_reason_ = reason;
  cancelled_.store(true, std::memory_order_release);
}

core::Transport::Request NcclTransport::post_send(const core::MessageKey& key) { return post(key, true); }
core::Transport::Request NcclTransport::post_recv(const core::MessageKey& key) { return post(key, false); }

core::Transport::Request NcclTransport::post(const core::MessageKey& key, bool is_send) {
  check_usable();
  const size_t ci = channel_for(key, is_send);
  Buffer buffer = is_send ? buffers_.send_buffer(key) : buffers_.recv_buffer(key);
  const TensorView& v = buffer.view;
  ASYNCPP_ARG_CHECK(v.device == DeviceKind::cuda && v.device_index == device_, "stage ", stage_, ": the buffer to ",
                    core::describe(key, is_send), " is on ", v.device == DeviceKind::cuda ? "cuda:" : "cpu",
                    v.device == DeviceKind::cuda ? std::to_string(v.device_index) : "",
                    " but the NCCL transport runs on cuda:", device_, "; keep the stage's model and buffers there");
  ASYNCPP_ARG_CHECK(v.contiguous, "stage ", stage_, ": the buffer to ", core::describe(key, is_send),
                    " is not contiguous; pass tensor.contiguous()");

  Channel& ch = channels_[ci];
  const Api& nccl = api();
  DeviceGuard guard(device_);
  Pending p{key, is_send, ci, nullptr, std::move(buffer.keep_alive)};
  try {
    // The transfer waits for the compute stream's work so far: a send's payload is produced there,
    // and a receive buffer's memory may have been used there last (the caching allocator reuses
    // blocks per stream).
    wait_for_compute(as_stream(compute_stream_), as_stream(ch.stream));
    enqueue_transfer(nccl, is_send, v.data, static_cast<size_t>(v.nbytes()), is_send ? 1 : 0, ch.comm,
                     as_stream(ch.stream));
    p.done = record_done(as_stream(ch.stream));
  } catch (const Error& e) {
    fail(detail::concat("stage ", stage_, ": could not post ", core::describe(key, is_send), " (rank ",
                        ch.spec.peer_rank, "): ", e.what()));
  }
  const Request id = next_request_++;
  {
    std::lock_guard<std::mutex> lock(described_mu_);
    described_.emplace(id, detail::concat(core::describe(key, is_send), " (rank ", ch.spec.peer_rank, ", ",
                                          v.nbytes(), " bytes)"));
  }
  pending_.emplace(id, std::move(p));
  return id;
}

bool NcclTransport::poll(const Pending& p) {
  const cudaError_t q = cudaEventQuery(as_event(p.done));
  if (q == cudaSuccess) return true;
  // NotReady also lands in the runtime's last-error slot; clear it, or the next launch's
  // cudaGetLastError() check (e.g. an optimizer kernel on this thread) would report it.
  (void)cudaGetLastError();
  const Channel& ch = channels_[p.channel];
  if (q != cudaErrorNotReady) {
    fail(detail::concat("stage ", stage_, ": ", core::describe(p.key, p.is_send), " (rank ", ch.spec.peer_rank,
                        ") failed with CUDA error ", cudaGetErrorName(q), ": ", cudaGetErrorString(q)));
  }
  Result async = status::kSuccess;
  const Result got = api().ncclCommGetAsyncError(ch.comm, &async);
  if (got == status::kSuccess && async != status::kSuccess && async != status::kInProgress)
    fail(detail::concat("stage ", stage_, ": ", core::describe(p.key, p.is_send), " (rank ", ch.spec.peer_rank,
                        ") failed: NCCL reported an asynchronous error (", async, "): ",
                        status::nccl_error_string(async), " -- the peer has probably failed"));
  return false;
}

void NcclTransport::retire(Request request) {
  auto it = pending_.find(request);
  Pending& p = it->second;
  // Later compute reads the received data: order it after the receive on the device too.
  if (!p.is_send) order_after(as_stream(compute_stream_), as_event(p.done));
  cudaEventDestroy(as_event(p.done));
  pending_.erase(it);  // drops keep_alive: the buffer may now be freed or reused
  std::lock_guard<std::mutex> lock(described_mu_);
  described_.erase(request);
}

std::vector<std::string> NcclTransport::pending_descriptions() const {
  std::lock_guard<std::mutex> lock(described_mu_);
  std::vector<std::string> out;
  out.reserve(described_.size());
  for (const auto& [id, what] : described_) out.push_back(what);
  return out;
}

bool NcclTransport::test(Request request) {
  check_usable();
  auto it = pending_.find(request);
  ASYNCPP_ARG_CHECK(it != pending_.end(), "stage ", stage_, ": unknown or already completed request ", request);
  DeviceGuard guard(device_);
  if (!poll(it->second)) return false;
  retire(request);
  return true;
}

void NcclTransport::wait(Request request, double timeout_s) {
  check_usable();
  ASYNCPP_ARG_CHECK(timeout_s > 0, "timeout_s must be > 0 (got ", timeout_s, ")");
  auto it = pending_.find(request);
  ASYNCPP_ARG_CHECK(it != pending_.end(), "stage ", stage_, ": unknown or already completed request ", request);
  DeviceGuard guard(device_);
  const Pending& p = it->second;
  const auto start = Clock::now();
  while (!poll(p)) {
    if (cancelled_.load(std::memory_order_acquire)) check_usable();  // throws
    const double waited = seconds_since(start);
    if (waited > timeout_s)
      fail(detail::concat("stage ", stage_, ": ", core::describe(p.key, p.is_send), " (rank ",
                          channels_[p.channel].spec.peer_rank, ") made no progress for ", timeout_s,
                          " s: the peer is stalled or has failed; every NCCL communicator of stage ", stage_,
                          " was aborted"));
    // Spin briefly for low latency, then back off so a long wait does not burn a core.
    if (waited < 2e-4)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  retire(request);
}

void NcclTransport::fail(const std::string& what) {
  abort_all();
  failure_ = what;
  throw Error(what);
}

void NcclTransport::abort_all() {
  for (Channel& ch : channels_) {
    if (ch.comm) api().ncclCommAbort(ch.comm);  // also stops this rank's in-flight NCCL kernels
    ch.comm = nullptr;
  }
  for (auto& [id, p] : pending_)
    if (p.done) cudaEventDestroy(as_event(p.done));
  pending_.clear();
  std::lock_guard<std::mutex> lock(described_mu_);
  described_.clear();
}

void NcclTransport::close(double timeout_s) {
  if (closed_) return;
  closed_ = true;
  DeviceGuard guard(device_);
  std::string unfinished;
  const auto start = Clock::now();
  for (auto& [id, p] : pending_) {
    while (failure_.empty() && cudaEventQuery(as_event(p.done)) == cudaErrorNotReady &&
           seconds_since(start) < timeout_s) {
      (void)cudaGetLastError();  // NotReady is not an error (see poll)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (cudaEventQuery(as_event(p.done)) != cudaSuccess && unfinished.empty())
      unfinished = core::describe(p.key, p.is_send);
  }
  cudaGetLastError();
  if (!unfinished.empty()) {
    abort_all();
  } else {
    for (auto& [id, p] : pending_) cudaEventDestroy(as_event(p.done));
    pending_.clear();
    std::lock_guard<std::mutex> lock(described_mu_);
    described_.clear();
    for (Channel& ch : channels_) {
      if (ch.comm) api().ncclCommDestroy(ch.comm);  // all transfers are done: a clean shutdown
      ch.comm = nullptr;
    }
  }
  for (Channel& ch : channels_)
    if (ch.stream) cudaStreamDestroy(as_stream(ch.stream));
  channels_.clear();
  ASYNCPP_CHECK(unfinished.empty(), "stage ", stage_, ": closing the NCCL transport with a transfer still "
                "incomplete after ", timeout_s, " s (", unfinished, "); its communicators were aborted");
}

}  // namespace asyncpp::nccl
#endif  // ASYNCPP_WITH_CUDA
