#include "bindings/message_board.h"

#include <atomic>
#include <string>

#include "bindings/tensor_args.h"
#include "core/error.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {

const char* kind_name(core::MessageKind kind) {
  return kind == core::MessageKind::activation ? "activation" : "gradient";
}

}  // namespace

TensorView view_of_tensor(const py::object& tensor, const py::object& to_dlpack, const char* what) {
  py::object capsule = to_dlpack(tensor);  // holds the storage only while we read the view
  TensorView v = borrow_tensor(capsule, what);
  expect_contiguous(v, what);
  return v;
}

MessageBoard::SendHold::~SendHold() {
  if (!tensor || !Py_IsInitialized()) return;  // interpreter gone: nothing left to release
  py::gil_scoped_acquire gil;
  tensor = py::object();
}

MessageBoard::MessageBoard(py::object host)
    : host_(std::move(host)),
      to_dlpack_(py::module_::import("torch.utils.dlpack").attr("to_dlpack")) {
  ASYNCPP_ARG_CHECK(py::hasattr(host_, "new_recv_buffer"), "the stage host must have new_recv_buffer(kind) "
                    "returning the tensor a receive of that kind lands in");
}

MessageBoard::~MessageBoard() {
  // Owned by a Python object, so destroyed with the GIL held; slots and pending sends go with it.
  collect_finished_sends();
}

void MessageBoard::put_send(core::MessageKind kind, int step, int microbatch, py::object tensor) {
  auto what = [&] {  // built only for an error message: a send allocates nothing here
    return "the " + std::string(kind_name(kind)) + " to send for step " + std::to_string(step) + ", microbatch " +
           std::to_string(microbatch);
  };
  ASYNCPP_ARG_CHECK(!tensor.is_none(), "the stage host returned None as ", what(), "; forward/backward must "
                    "return the tensor to send when the stage has a neighbour on that side");
  TensorView view;
  try {
    view = view_of_tensor(tensor, to_dlpack_, "");
  } catch (const ArgumentError&) {
    view_of_tensor(tensor, to_dlpack_, what().c_str());  // throws again, naming the message
    throw;
  }
  outgoing_[index(kind)].push_back(Outgoing{Tag{step, microbatch}, std::move(tensor), view});
}

MessageBoard::Outgoing MessageBoard::take_outgoing(core::MessageKind kind, Tag tag) {
  auto& list = outgoing_[index(kind)];
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].tag == tag) {
      Outgoing out = std::move(list[i]);
      list.erase(list.begin() + static_cast<long>(i));
      return out;
    }
  }
  ASYNCPP_CHECK(false, "no ", kind_name(kind), " to send for step ", tag.step, ", microbatch ", tag.microbatch,
                ": the send was posted before the ", kind == core::MessageKind::activation ? "forward" : "backward",
                " that produces it returned");
}

py::object MessageBoard::take_send_object(core::MessageKind kind, int step, int microbatch) {
  return take_outgoing(kind, Tag{step, microbatch}).tensor;
}

size_t MessageBoard::claim(core::MessageKind kind, Tag tag) {
  auto& slots = slots_[index(kind)];
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!slots[i].taken) {
      slots[i].taken = true;
      slots[i].holds = tag;
      return i;
    }
  }
  // Only while the pipeline fills up: later, backward returns a slot for every receive posted.
  const bool had_gil = PyGILState_Check() != 0;
  std::unique_ptr<py::gil_scoped_acquire> gil;
  if (!had_gil) gil = std::make_unique<py::gil_scoped_acquire>();
  py::object tensor = host_.attr("new_recv_buffer")(static_cast<int>(kind));
  const std::string what = std::string("new_recv_buffer(") + std::to_string(static_cast<int>(kind)) + ")";
  TensorView view = view_of_tensor(tensor, to_dlpack_, what.c_str());
  slots.push_back(Slot{std::move(tensor), std::move(view), tag, true});
  return slots.size() - 1;
}

py::object MessageBoard::claim_recv_object(core::MessageKind kind, int step, int microbatch) {
  return slots_[index(kind)][claim(kind, Tag{step, microbatch})].tensor;
}

py::object MessageBoard::received(core::MessageKind kind, int step, int microbatch) const {
  for (const Slot& s : slots_[index(kind)])
    if (s.taken && s.holds == Tag{step, microbatch}) return s.tensor;
  ASYNCPP_CHECK(false, "no received ", kind_name(kind), " for step ", step, ", microbatch ", microbatch,
                ": the schedule runs this computation before its receive");
}

void MessageBoard::release(core::MessageKind kind, int step, int microbatch) {
  for (Slot& s : slots_[index(kind)]) {
    if (s.taken && s.holds == Tag{step, microbatch}) {
      s.taken = false;
      return;
    }
  }
}

void MessageBoard::collect_finished_sends() {
  for (auto& hold : holds_) {
    if (hold->tensor && hold.use_count() == 1) {  // the transport has let go of it
      std::atomic_thread_fence(std::memory_order_acquire);  // its last read of the data came first
      hold->tensor = py::object();  // decref here, with the GIL held
    }
  }
}

core::Buffer MessageBoard::send_buffer(const core::MessageKey& key) {
  Outgoing out = take_outgoing(key.kind, Tag{key.step, key.microbatch});
  // The tensor must outlive the transfer: a free hold keeps it (moving a reference needs no GIL).
  std::shared_ptr<SendHold>* hold = nullptr;
  for (auto& h : holds_) {
    if (!h->tensor && h.use_count() == 1) {
      hold = &h;
      break;
    }
  }
  if (hold == nullptr) {  // only while the pipeline fills up
    holds_.push_back(std::make_shared<SendHold>());
    hold = &holds_.back();
  }
  (*hold)->tensor = std::move(out.tensor);
  // An aliasing reference: shares the hold's count, so handing it out allocates nothing.
  return core::Buffer{out.view, std::shared_ptr<void>(*hold, hold->get())};
}

core::Buffer MessageBoard::recv_buffer(const core::MessageKey& key) {
  const size_t i = claim(key.kind, Tag{key.step, key.microbatch});
  return core::Buffer{slots_[index(key.kind)][i].view, nullptr};  // the board keeps the slot's tensor
}

}  // namespace asyncpp::bindings
