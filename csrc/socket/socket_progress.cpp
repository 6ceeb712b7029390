// The socket transport's progress thread -- one poll loop over every channel -- and the byte
// moving (pump*) that it and the executor's thread both run, each channel's queued sends and
// receives in order (socket_transport.cpp sets the channels up and posts the requests).
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include "core/error.h"
#include "socket/socket_transport.h"
#include "socket/socket_wire.h"

namespace asyncpp::sock {

using wire::errno_text;
using wire::kind_name;
using wire::kMagic;

// ---- the progress thread -----------------------------------------------------------------------
void SocketTransport::progress_loop() {
  std::vector<pollfd> fds;
  std::vector<size_t> which;
  while (true) {
    fds.clear();
    which.clear();
    fds.push_back(pollfd{wake_fd_, POLLIN, 0});
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      if (failure_.empty()) {
        for (size_t i = 0; i < channels_.size(); ++i) {
          const Channel& c = channels_[i];
          // Idle (a peer that closed is no error yet), or the executor's thread polls it itself.
          if (!progress_owned(c)) continue;
          fds.push_back(pollfd{c.fd, static_cast<short>(c.spec.is_send ? POLLOUT : POLLIN), 0});
          which.push_back(i);
        }
      }
    }
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      std::lock_guard<std::mutex> lock(mu_);
      fail_locked(detail::concat(where(), "poll() failed: ", errno_text(errno)));
      continue;
    }
    if (fds[0].revents & POLLIN) {
      uint64_t drained;
      (void)!read(wake_fd_, &drained, sizeof(drained));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 1; k < fds.size() && failure_.empty(); ++k) {
      if (fds[k].revents == 0) continue;
      Channel& c = channels_[which[k - 1]];
      if (!progress_owned(c)) continue;
      if (!pump(c)) break;
    }
  }
}

// Errors and hang-ups surface as failed reads/writes, with their reason.
bool SocketTransport::pump(Channel& c) {
  while (c.queue_head < c.queue.size()) {
    Op& op = ops_[c.queue[c.queue_head]];
    const bool finished = op.is_send ? pump_send(c, op) : pump_recv(c, op);
    if (!failure_.empty()) return false;
    if (!finished) return true;  // the socket would block: poll again
    op.state = State::done;
    ++c.queue_head;
    }
  c.queue.clear();  // keeps its capacity: no allocation per message
  c.queue_head = 0;
  return true;
}

bool SocketTransport::pump_send(Channel& c, Op& op) {
  const uint64_t total = sizeof(Header) + op.header.nbytes;
  while (op.done_bytes < total) {
    iovec iov[2];
    int n = 0;
    if (op.done_bytes < sizeof(Header)) {
      iov[n++] = {reinterpret_cast<char*>(&op.header) + op.done_bytes, sizeof(Header) - op.done_bytes};
      iov[n++] = {op.buffer.view.data, op.header.nbytes};
    } else {
      iov[n++] = {static_cast<char*>(op.buffer.view.data) + (op.done_bytes - sizeof(Header)), total - op.done_bytes};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    const ssize_t k = sendmsg(c.fd, &msg, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      fail_locked(detail::concat(where(), describe_op(op), " failed -- stage ", c.spec.peer, " (rank ",
                                 c.spec.peer_rank, ") closed the connection; it has probably exited: ",
                                 errno_text(errno)));
      return false;
    }
    op.done_bytes += static_cast<uint64_t>(k);
  }
  return true;
}

bool SocketTransport::pump_recv(Channel& c, Op& op) {
  const uint64_t expected = static_cast<uint64_t>(op.buffer.view.nbytes());
  while (true) {
    const bool in_header = op.done_bytes < sizeof(Header);
    const uint64_t total = sizeof(Header) + (in_header ? expected : op.header.nbytes);
    if (!in_header && op.done_bytes == total) return true;
    iovec iov[2];
    int n = 0;
    if (in_header) {
      iov[n++] = {reinterpret_cast<char*>(&op.header) + op.done_bytes, sizeof(Header) - op.done_bytes};
      if (expected > 0) iov[n++] = {op.buffer.view.data, expected};
    } else {
      iov[n++] = {static_cast<char*>(op.buffer.view.data) + (op.done_bytes - sizeof(Header)), total - op.done_bytes};
    }
    const ssize_t k = readv(c.fd, iov, n);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    if (k <= 0) {
      fail_locked(detail::concat(where(), describe_op(op), " failed -- stage ", c.spec.peer, " (rank ",
                                 c.spec.peer_rank, ") closed the connection; it has probably exited",
                                 k < 0 ? ": " + errno_text(errno) : std::string()));
      return false;
    }
    const bool had_header = !in_header;
    op.done_bytes += static_cast<uint64_t>(k);
    if (had_header || op.done_bytes < sizeof(Header)) continue;
    // The header is complete: check it names exactly the message this receive expects.
    const Header& h = op.header;
    if (h.magic != kMagic) {
      fail_locked(detail::concat(where(), "the stream from stage ", c.spec.peer, " (rank ", c.spec.peer_rank,
                                 ") is corrupt (bad message header) while waiting for ", describe_op(op)));
      return false;
    }
    if (h.kind != static_cast<uint32_t>(op.key.kind) || h.step != op.key.step || h.microbatch != op.key.microbatch) {
      fail_locked(detail::concat(where(), "expected ", describe_op(op), " but stage ", c.spec.peer, " sent step ",
                                 h.step, ", microbatch ", h.microbatch,
                                 ": the two stages run different schedules or step ranges"));
      return false;
    }
    if (h.nbytes != expected) {
      fail_locked(detail::concat(where(), kind_name(op.key.kind), " (step ", h.step, ", microbatch ",
                                 h.microbatch, ") from stage ", c.spec.peer, " (rank ", c.spec.peer_rank, ") is ",
                                 h.nbytes, " bytes but this stage expects ", expected,
                                 ": the stages disagree on the boundary tensor's shape or dtype"));
      return false;
    }
  }
}

}  // namespace asyncpp::sock
