// The CUDA-free part of the NCCL transport: channel-list checks and unique ids, usable (and
// testable) in every build.
#include "core/error.h"
#include "nccl/nccl_check.h"
#include "nccl/nccl_transport.h"

namespace asyncpp::nccl {
namespace {

const char* kind_name(core::MessageKind kind) {
  return kind == core::MessageKind::activation ? "activation" : "gradient";
}

}  // namespace

void validate_channels(int stage, const std::vector<ChannelSpec>& channels) {
  ASYNCPP_ARG_CHECK(stage >= 0, "stage must be >= 0 (got ", stage, ")");
  bool seen[2][2] = {{false, false}, {false, false}};
  for (size_t i = 0; i < channels.size(); ++i) {
    const ChannelSpec& c = channels[i];
    const int k = static_cast<int>(c.kind);
    ASYNCPP_ARG_CHECK(k == 0 || k == 1, "channels[", i, "]: kind must be 0 (activation) or 1 (gradient), got ",
                      k);
    // Activations flow forward (stage -> stage+1), gradients backward (stage -> stage-1).
    const int forward_peer = (c.kind == core::MessageKind::activation) == c.is_send ? stage + 1 : stage - 1;
    ASYNCPP_ARG_CHECK(c.peer == forward_peer, "channels[", i, "]: stage ", stage, " ",
                      c.is_send ? "sends " : "receives ", kind_name(c.kind), "s ", c.is_send ? "to" : "from",
                      " stage ", forward_peer, ", not stage ", c.peer,
                      " (activations go to the next stage, gradients to the previous one)");
    ASYNCPP_ARG_CHECK(c.peer_rank >= 0, "channels[", i, "]: peer_rank must be >= 0 (got ", c.peer_rank, ")");
    ASYNCPP_ARG_CHECK(!seen[k][c.is_send], "channels[", i, "]: a second ", kind_name(c.kind),
                      c.is_send ? " send" : " receive", " channel; give each (kind, direction) once");
    seen[k][c.is_send] = true;
  }
}

UniqueId new_unique_id() {
  const Api& a = api();
  UniqueId id{};
  ASYNCPP_NCCL_CHECK(a.ncclGetUniqueId(&id));
  return id;
}

}  // namespace asyncpp::nccl
