// What the executor needs from a transport: post a send or a receive of one boundary message,
// then test or wait for it. Payload buffers belong to the stage host; a transport only moves them.
// Implementations: the socket transport (csrc/socket, CPU tensors over TCP), the NCCL transport
// (csrc/nccl, CUDA tensors), and torch.distributed's gloo driven from Python through the bindings.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor_view.h"

namespace asyncpp::core {

enum class MessageKind : uint8_t { activation = 0, gradient = 1 };

struct MessageKey {
  MessageKind kind;
  int32_t step;
  int32_t microbatch;
  int32_t peer;  // the other stage
};

std::string describe(const MessageKey& key, bool is_send);

// A payload buffer plus whatever keeps its memory alive; a transport holds `keep_alive` until the
// transfer has completed (or the transport is torn down), then drops it.
struct Buffer {
  TensorView view;
  std::shared_ptr<void> keep_alive;
};

// Where C++ transports get payload buffers. Sends must already hold the data; receive buffers are
// filled by the transport. Called on the executor's thread only.
class BufferProvider {
 public:
  virtual ~BufferProvider() = default;
  virtual Buffer send_buffer(const MessageKey& key) = 0;
  virtual Buffer recv_buffer(const MessageKey& key) = 0;
};

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
