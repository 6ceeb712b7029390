#include "socket/socket_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <algorithm>

#include "core/error.h"
#include "socket/socket_wire.h"

namespace asyncpp::sock {
namespace {

using wire::errno_text;
using wire::Hello;
using wire::kHello;
using wire::kind_name;
using wire::kMagic;
using Clock = std::chrono::steady_clock;

void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  ASYNCPP_CHECK(flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, "fcntl(O_NONBLOCK) failed: ",
                errno_text(errno));
}

void set_nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // small messages go out at once
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Blocking exchange of a fixed-size record on a blocking socket, bounded by `deadline`.
bool io_all(int fd, void* data, size_t n, bool is_write, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pfd{fd, static_cast<short>(is_write ? POLLOUT : POLLIN), 0};
    if (poll(&pfd, 1, remaining_ms(deadline)) <= 0) return false;
    const ssize_t k = is_write ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (k <= 0) {
      if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return false;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

int connect_to(const std::string& host, int port, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    error = std::string("cannot resolve ") + host + ": " + gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  while (true) {  // the listener exists before its address is published, but retry refusals
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0) break;
    error = errno_text(errno);
    if (fd >= 0) ::close(fd);
    fd = -1;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  freeaddrinfo(found);
  return fd;
}

}  // namespace

// ---- listener ----------------------------------------------------------------------------------
Listener::Listener(const std::string& bind_host) {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASYNCPP_CHECK(fd_ >= 0, "socket() failed: ", errno_text(errno));
  const int one = 1;
  setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  ASYNCPP_ARG_CHECK(inet_pton(AF_INET, bind_host.c_str(), &addr.sin_addr) == 1, "bind_host must be an IPv4 "
                    "address such as 0.0.0.0 or 127.0.0.1, got '", bind_host, "'");
  if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd_, 16) != 0) {
    const int err = errno;
    ::close(fd_);
    ASYNCPP_CHECK(false, "cannot listen on ", bind_host, ": ", errno_text(err));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
}

Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
}

// ---- channel checks ----------------------------------------------------------------------------
void validate_channels(int stage, const std::vector<ChannelSpec>& channels) {
  bool seen[2][2] = {{false, false}, {false, false}};
  for (size_t i = 0; i < channels.size(); ++i) {
    const ChannelSpec& c = channels[i];
    const bool act = c.kind == core::MessageKind::activation;
    const int want = act == c.is_send ? stage + 1 : stage - 1;
    ASYNCPP_ARG_CHECK(c.peer == want, "channels[", i, "]: stage ", stage, (c.is_send ? " sends " : " receives "),
                      act ? "activations" : "gradients", (c.is_send ? " to" : " from"), " stage ", want,
                      ", not stage ", c.peer);
    ASYNCPP_ARG_CHECK(c.peer_rank >= 0, "channels[", i, "]: peer_rank must be >= 0, got ", c.peer_rank);
    ASYNCPP_ARG_CHECK(!c.is_send || (c.port > 0 && c.port < 65536 && !c.host.empty()), "channels[", i,
                      "]: a send channel needs the receiver's host and a port in [1, 65535]");
    bool& s = seen[act ? 0 : 1][c.is_send ? 1 : 0];
    ASYNCPP_ARG_CHECK(!s, "channels[", i, "]: a second ", act ? "activation" : "gradient",
                      c.is_send ? " send" : " receive", " channel");
    s = true;
  }
}

// ---- set-up ------------------------------------------------------------------------------------
SocketTransport::SocketTransport(int stage, const Listener& listener, std::vector<ChannelSpec> channels,
                                 uint64_t token, double connect_timeout_s, core::BufferProvider& buffers,
                                 int64_t recv_spin_us, int64_t inline_recv_bytes)
    : stage_(stage), buffers_(buffers), recv_spin_(recv_spin_us), inline_recv_bytes_(inline_recv_bytes) {
  ASYNCPP_ARG_CHECK(connect_timeout_s > 0, "connect_timeout_s must be > 0, got ", connect_timeout_s);
  ASYNCPP_ARG_CHECK(recv_spin_us >= 0 && recv_spin_us <= kMaxRecvSpinUs, "recv_spin_us must lie in [0, ",
                    kMaxRecvSpinUs, "] (microseconds a receive polls before it blocks), got ", recv_spin_us);
  ASYNCPP_ARG_CHECK(inline_recv_bytes >= 0, "inline_recv_bytes must be >= 0 (the largest receive only the "
                    "executor's thread reads; 0 for none), got ", inline_recv_bytes);
  validate_channels(stage, channels);
  for (auto& spec : channels) channels_.push_back(Channel{std::move(spec), -1, {}, 0});
  try {
    connect_all(listener, token, connect_timeout_s);
  } catch (...) {
    for (auto& c : channels_)
      if (c.fd >= 0) ::close(c.fd);
    throw;
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  ASYNCPP_CHECK(wake_fd_ >= 0, "eventfd() failed: ", errno_text(errno));
  progress_ = std::thread([this] { progress_loop(); });
}

void SocketTransport::connect_all(const Listener& listener, uint64_t token, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  for (auto& c : channels_) {
    if (!c.spec.is_send) continue;
    std::string error;
    c.fd = connect_to(c.spec.host, c.spec.port, deadline, error);
    ASYNCPP_CHECK(c.fd >= 0, "stage ", stage_, ": socket transport: cannot connect the ", kind_name(c.spec.kind),
                  " channel to stage ", c.spec.peer, " (rank ", c.spec.peer_rank, ") at ", c.spec.host, ":",
                  c.spec.port, " within ", timeout_s, " s: ", error, " -- is that rank running and reachable?");
    Hello hello{kHello, static_cast<uint32_t>(c.spec.kind), stage_, 0, token};
    ASYNCPP_CHECK(io_all(c.fd, &hello, sizeof(hello), true, deadline), "stage ", stage_,
                  ": socket transport: stage ", c.spec.peer, " (rank ", c.spec.peer_rank,
                  ") accepted the connection but did not take its greeting -- it has probably exited");
  }
  // Receivers: accept until every receive channel has its sender; anything else is refused.
  size_t missing = 0;
  for (const auto& c : channels_) missing += c.spec.is_send ? 0 : 1;
  while (missing > 0) {
    pollfd pfd{listener.fd(), POLLIN, 0};
    if (poll(&pfd, 1, remaining_ms(deadline)) <= 0) {
      std::string who;
      for (const auto& c : channels_)
        if (!c.spec.is_send && c.fd < 0)
          who += detail::concat(who.empty() ? "" : ", ", kind_name(c.spec.kind), " from stage ", c.spec.peer,
                                " (rank ", c.spec.peer_rank, ")");
      ASYNCPP_CHECK(false, "stage ", stage_, ": socket transport: no connection within ", timeout_s, " s for: ",
                    who, " -- that rank has not started, failed, or cannot reach this host");
    }
    const int fd = accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Hello hello{};
    if (!io_all(fd, &hello, sizeof(hello), false, deadline) || hello.magic != kHello || hello.token != token) {
      ::close(fd);  // a stray connection, or a peer of another run
      continue;
    }
    bool matched = false;
    for (auto& c : channels_) {
      if (!c.spec.is_send && c.fd < 0 && static_cast<uint32_t>(c.spec.kind) == hello.kind &&
          c.spec.peer == hello.sender_stage) {
        c.fd = fd;
        matched = true;
        --missing;
        break;
      }
    }
    if (!matched) ::close(fd);
  }
  for (auto& c : channels_) {
    set_nodelay(c.fd);
    set_nonblocking(c.fd);
  }
}

SocketTransport::~SocketTransport() { close(); }

void SocketTransport::cancel(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_locked(detail::concat(where(), reason));
  wake();
}

void SocketTransport::close() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    for (const auto& op : ops_) {
      if (op.state != State::queued) continue;
      fail_locked(detail::concat(where(), "closed while ", describe_op(op), " was in flight"));
      break;
    }
    waiters_left_.wait(lock, [this] { return waiters_ == 0; });
  }
  wake();
  if (progress_.joinable()) progress_.join();
  for (auto& c : channels_)
    if (c.fd >= 0) ::close(c.fd);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& op : ops_) op.buffer = core::Buffer{};  // payloads are no longer ours to hold
}

// ---- requests ----------------------------------------------------------------------------------
size_t SocketTransport::channel_for(const core::MessageKey& key, bool is_send) const {
  for (size_t i = 0; i < channels_.size(); ++i)
    if (channels_[i].spec.kind == key.kind && channels_[i].spec.is_send == is_send && channels_[i].spec.peer == key.peer)
      return i;
  ASYNCPP_CHECK(false, "stage ", stage_, ": socket transport has no channel to ", core::describe(key, is_send),
                "; the pipeline's stage count and the transport's channels disagree");
}

std::string SocketTransport::where() const { return detail::concat("stage ", stage_, ": socket transport: "); }

std::string SocketTransport::describe_op(const Op& op) const {
  const ChannelSpec& s = channels_[op.channel].spec;
  return detail::concat(core::describe(op.key, op.is_send), " (rank ", s.peer_rank, ", ",
                        op.buffer.view.nbytes(), " bytes)");
}

void SocketTransport::check_open_locked(const core::MessageKey& key, bool is_send) const {
  ASYNCPP_CHECK(failure_.empty(), failure_);
  ASYNCPP_CHECK(!stopping_, where(), "posted ", core::describe(key, is_send), " after close()");
}

core::Transport::Request SocketTransport::post(const core::MessageKey& key, bool is_send) {
  const size_t ci = channel_for(key, is_send);
  {
    std::lock_guard<std::mutex> lock(mu_);  // a failed or closed transport says so, not the board
    check_open_locked(key, is_send);
  }
  core::Buffer buffer = is_send ? buffers_.send_buffer(key) : buffers_.recv_buffer(key);
  ASYNCPP_ARG_CHECK(buffer.view.device == DeviceKind::cpu, where(), "the buffer to ", core::describe(key, is_send),
                    " is a CUDA tensor; the socket transport moves CPU tensors (use the nccl or gloo transport "
                    "on CUDA)");
  size_t index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_open_locked(key, is_send);  // again: a cancel or close may have come meanwhile
    if (free_ops_.empty()) {
      ops_.emplace_back();
      free_ops_.push_back(ops_.size() - 1);
    }
    index = free_ops_.back();
    free_ops_.pop_back();
    Op& op = ops_[index];
    op.key = key;
    op.is_send = is_send;
    op.channel = ci;
    op.buffer = std::move(buffer);
    op.done_bytes = 0;
    op.state = State::queued;
    op.inline_recv = !is_send && static_cast<int64_t>(op.buffer.view.nbytes()) <= inline_recv_bytes_;
    if (is_send)
      op.header = Header{kMagic, static_cast<uint32_t>(key.kind), key.step, key.microbatch,
                         static_cast<uint64_t>(op.buffer.view.nbytes())};
    Channel& c = channels_[ci];
    c.queue.push_back(index);
    // Move what the socket takes right now on this thread: a small send usually completes here,
    // with no hand-over to the progress thread.
    if (c.queue.size() - c.queue_head == 1) pump(c);
    // Done, or read later by this thread while it waits: the progress thread need not know.
    if (op_state(index) != State::queued || !progress_owned(c)) return static_cast<Request>(index);
  }
  wake();
  return static_cast<Request>(index);
}

core::Transport::Request SocketTransport::post_send(const core::MessageKey& key) { return post(key, true); }
core::Transport::Request SocketTransport::post_recv(const core::MessageKey& key) { return post(key, false); }

bool SocketTransport::test(Request request) {
  core::Buffer release;  // dropped outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  ASYNCPP_CHECK(request >= 0 && static_cast<size_t>(request) < ops_.size() &&
                ops_[request].state != State::free, where(), "unknown request ", request);
  Op& op = ops_[request];
  if (op.state == State::queued) return false;
  ASYNCPP_CHECK(op.state == State::done, failure_);
  release = std::move(op.buffer);
  op.state = State::free;
  free_ops_.push_back(static_cast<size_t>(request));
  return true;
}

void SocketTransport::wait(Request request, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
  {
    std::unique_lock<std::mutex> lock(mu_);
    ASYNCPP_CHECK(request >= 0 && static_cast<size_t>(request) < ops_.size() &&
                  ops_[request].state != State::free, where(), "unknown request ", request);
    struct Waiting {  // counted while inside, so that close() can wait for this thread to leave
      SocketTransport& t;
      explicit Waiting(SocketTransport& transport) : t(transport) { ++t.waiters_; }
      ~Waiting() {
        if (--t.waiters_ == 0) t.waiters_left_.notify_all();
      }
    } waiting(*this);
    wait_on_sockets(lock, static_cast<size_t>(request), deadline);
    if (ops_[request].state == State::queued && failure_.empty()) {
      const std::string what = describe_op(ops_[request]);
      fail_locked(detail::concat(where(), what, ": no progress for ", timeout_s,
                                 " s (the peer is stalled or has failed)"));
      wake();
    }
  }
  test(request);  // retires it, or throws the failure
}

// A request is waited for on this thread: it polls the request's channel (which the progress
// thread leaves alone meanwhile) and every channel whose next receive it reads inline, and moves
// their bytes itself, so arriving data needs no hand-over between threads. Waiting for a receive
// polls without sleeping for the first recv_spin_ (socket_transport.h says why).
void SocketTransport::wait_on_sockets(std::unique_lock<std::mutex>& lock, size_t index,
                                      Clock::time_point deadline) {
  Channel& mine = channels_[ops_[index].channel];
  mine.waiter = true;
  uint64_t touched = 0;  // bit i: this wait moved bytes of channel i (a stage has at most 4)
  const Clock::time_point spin_until =
      ops_[index].is_send ? Clock::now() : std::min(Clock::now() + recv_spin_, deadline);
  while (ops_[index].state == State::queued && failure_.empty() && !stopping_) {
    wait_fds_.clear();
    for (size_t i = 0; i < channels_.size() && failure_.empty(); ++i) {
      Channel& c = channels_[i];
      if (&c != &mine && !reads_inline(c)) continue;
      touched |= uint64_t{1} << i;
      pump(c);
      if (&c == &mine ? c.queue_head < c.queue.size() : reads_inline(c)) {
        wait_fds_.push_back(pollfd{c.fd, static_cast<short>(c.spec.is_send ? POLLOUT : POLLIN), 0});
      }
    }
    if (ops_[index].state != State::queued || !failure_.empty()) break;
    lock.unlock();
    // Spinning: a zero timeout, so the sockets are looked at again at once (the lock is released
    // meanwhile, so the watchdog and the progress thread are never held up).
    const bool spinning = Clock::now() < spin_until;
    const int ready = poll(wait_fds_.data(), wait_fds_.size(), spinning ? 0 : std::min(remaining_ms(deadline), 100));
    if (spinning && ready == 0) sched_yield();  // another runnable thread of this CPU goes first
    lock.lock();
    if (ready == 0 && !spinning && Clock::now() >= deadline) break;
  }
  mine.waiter = false;
  // A channel this thread polled may now hold ops the progress thread moves: hand them back.
  for (size_t i = 0; i < channels_.size(); ++i) {
    if ((touched >> i & 1) && progress_owned(channels_[i])) {
      wake();
      break;
    }
  }
}

std::vector<std::string> SocketTransport::pending_descriptions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  // A failed request stays posted until the executor retires it: a report written as the failure
  // unwinds (a lost peer's) still names what this stage was waiting for.
  for (const auto& op : ops_) {
    if (op.state == State::queued) out.push_back(detail::concat("stage ", stage_, ": ", describe_op(op)));
    if (op.state == State::failed)
      out.push_back(detail::concat("stage ", stage_, ": ", describe_op(op), " (failed with the transport)"));
  }
  return out;
}

size_t SocketTransport::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.size() - free_ops_.size();
}

void SocketTransport::wake() {
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
}

void SocketTransport::fail_locked(const std::string& message) {
  if (!failure_.empty()) return;
  failure_ = message;
  for (auto& op : ops_)
    if (op.state == State::queued) op.state = State::failed;
  for (auto& c : channels_) {
    c.queue.clear();
    c.queue_head = 0;
    if (c.fd >= 0) shutdown(c.fd, SHUT_RDWR);  // the neighbours see the end and fail too
  }
}

}  // namespace asyncpp::sock
