// What both halves of the socket transport share: the wire's header words, the first record
// of a connection, and the wording of their errors (socket_transport.cpp sets channels up and
// posts requests; socket_progress.cpp moves the bytes).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "core/transport.h"

namespace asyncpp::sock::wire {

constexpr uint32_t kMagic = 0x41505031;  // "APP1": a message header
constexpr uint32_t kHello = 0x41505048;  // "APPH": the first bytes of a connection

struct Hello {
  uint32_t magic;
  uint32_t kind;
  int32_t sender_stage;
  int32_t pad;
  uint64_t token;
};

inline std::string errno_text(int err) { return std::string(std::strerror(err)); }

inline const char* kind_name(core::MessageKind kind) {
  return kind == core::MessageKind::activation ? "activation" : "gradient";
}

}  // namespace asyncpp::sock::wire
