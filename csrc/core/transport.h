// What the executor needs from a transport: post a send or a receive of one boundary message,
// then test or wait for it. Payload buffers belong to the stage host; a transport only moves them.
// Implementations: the gloo transport (torch.distributed, driven from Python through the
// bindings) and the NCCL transport (csrc/nccl).
#pragma once
#include <cstdint>
#include <string>

namespace asyncpp::core {

enum class MessageKind : uint8_t { activation = 0, gradient = 1 };

struct MessageKey {
  MessageKind kind;
  int32_t step;
  int32_t microbatch;
  int32_t peer;  // the other stage
};

std::string describe(const MessageKey& key, bool is_send);

class Transport {
 public:
  using Request = int64_t;
  virtual ~Transport() = default;
  virtual Request post_send(const MessageKey& key) = 0;
  virtual Request post_recv(const MessageKey& key) = 0;
  // Non-blocking: has the request completed? Throws if it failed.
  virtual bool test(Request request) = 0;
  // Blocks until done; throws asyncpp::Error if `timeout_s` passes first or the transfer fails.
  virtual void wait(Request request, double timeout_s) = 0;
};

}  // namespace asyncpp::core
