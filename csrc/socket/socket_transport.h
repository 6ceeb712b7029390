// The CPU transport: boundary messages over TCP, one connection per neighbour and direction
// (activations s -> s+1, gradients s+1 -> s), moved by one progress thread per stage.
//
// Each message is a 24-byte header (magic, kind, step, microbatch, byte count) followed by the
// payload, read straight into the receive buffer. Messages of one kind between two stages are
// posted in the same order on both ends (the schedule's order), so each connection is a FIFO and
// the header only confirms what the receiver expects: a mismatch (another schedule, another
// tensor shape) fails the transport with a message naming both sides. Any failure -- a peer that
// closes its connection, a corrupt stream, a wait that times out -- fails every pending request
// and shuts the sockets down, so the neighbours fail too instead of waiting.
//
// The executor's thread posts and waits. What a socket takes at once is moved on the executor's
// thread (a small send completes inside post_send; a receive being waited for is read by the
// waiter), and a progress thread moves the rest, so large transfers advance while the stage
// computes. Receives of at most `inline_recv_bytes` never involve the progress thread: the
// executor's thread reads them whenever it waits for anything (a wake-up of another thread costs
// more than such a message takes to copy, and on a core the stage computes on it is a context
// switch per message). No allocation per message once the request pool has grown.
#pragma once
#include <poll.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/transport.h"

namespace asyncpp::sock {

// A listening TCP socket on `bind_host` ("0.0.0.0" for every interface) and a port the OS picks.
// Open it before publishing its address: peers may connect as soon as they read it.
class Listener {
 public:
  explicit Listener(const std::string& bind_host);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int port() const { return port_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// One connection of this stage: which messages it carries and this stage's role on it.
struct ChannelSpec {
  core::MessageKind kind;
  bool is_send;          // this stage sends (and connects) or receives (and accepts)
  int32_t peer;          // the other stage
  int32_t peer_rank;     // the other stage's process rank, for messages
  std::string host;      // senders: where the receiver listens
  int port = 0;
};

// Checks a channel list for `stage` of a pipeline (activations go to stage+1 and come from
// stage-1, gradients go to stage-1 and come from stage+1, each at most once). Throws
// asyncpp::ArgumentError naming the bad entry.
void validate_channels(int stage, const std::vector<ChannelSpec>& channels);

// The longest a receive may spin before it blocks (SocketTransport's recv_spin_us): 1 s.
inline constexpr int64_t kMaxRecvSpinUs = 1'000'000;
// Receives of at most this many payload bytes are read by the executor's thread alone (the
// default of SocketTransport's inline_recv_bytes): what a loopback socket buffers without a reader.
inline constexpr int64_t kDefaultInlineRecvBytes = 64 * 1024;

class SocketTransport final : public core::Transport {
 public:
  // Connects every channel (senders connect to their receivers' listeners, receivers accept on
  // `listener`), within `connect_timeout_s`. `token` identifies the run: a connection presenting
  // another token is refused. `buffers` must outlive the transport. `recv_spin_us`: how long a
  // wait for a receive polls its socket without sleeping before it blocks (0: block at once). A
  // sleeping receiver costs the sender a cross-CPU wake-up on the critical path (hundreds of us
  // on some VMs); a spinning one costs a core that is otherwise idle while the stage waits.
  // `inline_recv_bytes`: receives up to this payload size are read only by the executor's thread,
  // during its waits (0: every receive may be read by the progress thread as its data arrives).
  SocketTransport(int stage, const Listener& listener, std::vector<ChannelSpec> channels, uint64_t token,
                  double connect_timeout_s, core::BufferProvider& buffers, int64_t recv_spin_us = 0,
                  int64_t inline_recv_bytes = kDefaultInlineRecvBytes);
  ~SocketTransport() override;
  SocketTransport(const SocketTransport&) = delete;
  SocketTransport& operator=(const SocketTransport&) = delete;

  Request post_send(const core::MessageKey& key) override;
  Request post_recv(const core::MessageKey& key) override;
  bool test(Request request) override;
  void wait(Request request, double timeout_s) override;

  // What each posted, unretired request is (failed ones marked so); safe from another thread (the
  // watchdog).
  std::vector<std::string> pending_descriptions() const;
  size_t pending() const;
  // Ends the run from another thread: every pending and later request fails with `reason`, and
  // the sockets are shut down, which wakes a wait in progress at once (and fails the neighbours'
  // waits, as any failure does). Thread-safe; the first failure's message is the one kept.
  void cancel(const std::string& reason);
  // Stops the progress thread and closes the connections. Idempotent, and safe while the
  // executor's thread waits: pending requests fail first, and the descriptors are closed only
  // once that thread has left its poll (a descriptor closed under a poll could be reused).
  void close();

 private:
  struct Header {
    uint32_t magic;
    uint32_t kind;
    int32_t step;
    int32_t microbatch;
    uint64_t nbytes;
  };
  enum class State : uint8_t { free, queued, done, failed };
  struct Op {
    core::MessageKey key{};
    bool is_send = false;
    size_t channel = 0;
    core::Buffer buffer;
    Header header{};
    uint64_t done_bytes = 0;  // header + payload bytes moved so far
    State state = State::free;
    bool inline_recv = false;  // a receive only the executor's thread reads (inline_recv_bytes)
  };
  struct Channel {
    ChannelSpec spec;
    int fd = -1;
    std::vector<size_t> queue;  // ops in posting order; queue_head is the one in progress
    size_t queue_head = 0;
    bool waiter = false;        // the executor's thread is polling this socket itself
  };
  using Clock = std::chrono::steady_clock;

  Request post(const core::MessageKey& key, bool is_send);
  // Throws the failure, or that the transport is closed (mu_ held).
  void check_open_locked(const core::MessageKey& key, bool is_send) const;
  size_t channel_for(const core::MessageKey& key, bool is_send) const;
  void connect_all(const Listener& listener, uint64_t token, double timeout_s);
  void progress_loop();
  // Moves bytes of the channel's front ops; false when the channel failed (failure_ set).
  bool pump(Channel& c);
  void wait_on_sockets(std::unique_lock<std::mutex>& lock, size_t index, Clock::time_point deadline);
  State op_state(size_t index) const { return ops_[index].state; }
  // The channel's next op is a receive only the executor's thread reads.
  bool reads_inline(const Channel& c) const {
    return c.queue_head < c.queue.size() && ops_[c.queue[c.queue_head]].inline_recv;
  }
  // The channel has ops the progress thread moves (it is neither idle nor the executor's).
  bool progress_owned(const Channel& c) const {
    return c.queue_head < c.queue.size() && !c.waiter && !reads_inline(c);
  }
  bool pump_send(Channel& c, Op& op);
  bool pump_recv(Channel& c, Op& op);
  void fail_locked(const std::string& message);
  std::string describe_op(const Op& op) const;
  std::string where() const;
  void wake();

  int stage_;
  core::BufferProvider& buffers_;
  std::chrono::microseconds recv_spin_;
  int64_t inline_recv_bytes_;
  std::vector<pollfd> wait_fds_;        // the executor's poll set while it waits (reused)
  std::vector<Channel> channels_;
  mutable std::mutex mu_;            // guards ops_, free_ops_, channel queues, failure_
  std::vector<Op> ops_;
  std::vector<size_t> free_ops_;
  std::string failure_;
  bool stopping_ = false;
  int waiters_ = 0;                        // threads inside wait() (they poll the sockets)
  std::condition_variable waiters_left_;   // close() waits on it for waiters_ == 0
  int wake_fd_ = -1;                 // eventfd: new work or stop
  std::thread progress_;
};

}  // namespace asyncpp::sock
