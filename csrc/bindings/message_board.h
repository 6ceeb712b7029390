// Where boundary tensors wait between the stage host (Python) and a transport.
//
// The host's forward/backward return the tensor to send; the board keeps it until the transport
// takes it. Receives land in slots the board owns: tensors the host allocates once (through
// `host.new_recv_buffer(kind)`) and the board reuses, so a steady pipeline allocates nothing per
// message and calls into Python only for forward/backward themselves. A slot holding (kind, step,
// microbatch) stays taken until the backward of that microbatch has returned: autograd may have
// saved the received activation for it.
//
// Threads: every method runs on the executor's thread. Methods marked "GIL" need the GIL held;
// `send_buffer`/`recv_buffer` (the BufferProvider side, called by C++ transports with the GIL
// released) take it only to allocate a new slot. A send's tensor is held in one of a pool of
// holds; the transport keeps it alive through an aliasing reference to its hold (no allocation
// per message), and the board drops the tensor under the GIL, at its next GIL-holding call, once
// the transport has let go of the hold.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/transport.h"

namespace asyncpp::bindings {

class MessageBoard final : public core::BufferProvider {
 public:
  // `host` provides new_recv_buffer(kind) -> tensor (the shape and dtype agreed for that kind).
  explicit MessageBoard(pybind11::object host);
  ~MessageBoard() override;

  // GIL. Keeps `tensor` (contiguous, CPU or CUDA) as the payload of the send of `key`.
  void put_send(core::MessageKind kind, int step, int microbatch, pybind11::object tensor);
  // GIL. Takes the payload of the send of `key` (the Python transports keep it alive themselves).
  pybind11::object take_send_object(core::MessageKind kind, int step, int microbatch);
  // GIL. The slot tensor that received (kind, step, microbatch).
  pybind11::object received(core::MessageKind kind, int step, int microbatch) const;
  // GIL. Claims a free slot for the receive of (kind, step, microbatch) and returns its tensor.
  pybind11::object claim_recv_object(core::MessageKind kind, int step, int microbatch);
  // Frees the slot of (kind, step, microbatch), if any, for the next receive.
  void release(core::MessageKind kind, int step, int microbatch);
  // GIL. Drops the tensors of sends that have completed.
  void collect_finished_sends();

  core::Buffer send_buffer(const core::MessageKey& key) override;
  core::Buffer recv_buffer(const core::MessageKey& key) override;

  // Slots allocated so far, per kind (tests check that a steady pipeline stops allocating).
  size_t slot_count(core::MessageKind kind) const { return slots_[index(kind)].size(); }
  // Send holds allocated so far (tests check that a steady pipeline stops allocating them too).
  size_t send_hold_count() const { return holds_.size(); }

 private:
  struct Tag {
    int32_t step = -1;
    int32_t microbatch = -1;
    bool operator==(const Tag& o) const { return step == o.step && microbatch == o.microbatch; }
  };
  struct Slot {
    pybind11::object tensor;
    TensorView view;
    Tag holds;          // the message it holds or will receive
    bool taken = false;
  };
  struct Outgoing {
    Tag tag;
    pybind11::object tensor;
    TensorView view;
  };

  static size_t index(core::MessageKind kind) { return static_cast<size_t>(kind); }
  size_t claim(core::MessageKind kind, Tag tag);  // GIL held or not: takes it only to allocate
  Outgoing take_outgoing(core::MessageKind kind, Tag tag);

  // A send's tensor while a transport may read it. A hold that outlives the board (its transport
  // torn down later) releases the tensor under the GIL itself.
  struct SendHold {
    pybind11::object tensor;
    ~SendHold();
  };

  pybind11::object host_;
  pybind11::object to_dlpack_;
  std::vector<Slot> slots_[2];
  std::vector<Outgoing> outgoing_[2];
  // The pool: a hold the board alone references is finished (its tensor dropped at the next
  // collect_finished_sends) or free (empty). Grows only while the pipeline fills up.
  std::vector<std::shared_ptr<SendHold>> holds_;
};

// GIL. A contiguous CPU/CUDA tensor as a borrowed view (valid while the tensor lives).
TensorView view_of_tensor(const pybind11::object& tensor, const pybind11::object& to_dlpack, const char* what);

}  // namespace asyncpp::bindings
