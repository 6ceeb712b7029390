// The runtime's Python face: run one stage's program with a Python stage host and a Python
// transport (gloo via torch.distributed). The executor runs with the GIL released; it takes the
// GIL only to call back into Python.
#include <pybind11/stl.h>

#include <chrono>

#include "bindings/bindings.h"
#include "bindings/message_board.h"
#include "bindings/stage_runner.h"
#include "core/error.h"
#include "core/executor.h"
#include "core/segment.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {

using core::MessageKey;
using core::MessageKind;
using core::Transport;

// Calls the Python stage host: forward/backward get the received tensor (None on the pipeline's
// ends) and return the tensor to send; the board carries both. One Python call per instruction.
class PyStageHost final : public core::StageHost {
 public:
  PyStageHost(py::object host, MessageBoard& board, bool has_prev, bool has_next)
      : forward_(host.attr("forward")),
        backward_(host.attr("backward")),
        optimizer_step_(host.attr("optimizer_step")),
        board_(board),
        has_prev_(has_prev),
        has_next_(has_next) {}
  ~PyStageHost() override {
    py::gil_scoped_acquire gil;
    forward_ = backward_ = optimizer_step_ = py::object();
  }

  void forward(int step, int mb, int version) override {
    py::gil_scoped_acquire gil;
    board_.collect_finished_sends();
    py::object x = has_prev_ ? board_.received(MessageKind::activation, step, mb) : py::none();
    py::object out = forward_(step, mb, version, x);
    if (has_next_) board_.put_send(MessageKind::activation, step, mb, std::move(out));
  }
  void backward(int step, int mb, int version) override {
    py::gil_scoped_acquire gil;
    board_.collect_finished_sends();
    py::object grad = has_next_ ? board_.received(MessageKind::gradient, step, mb) : py::none();
    py::object out = backward_(step, mb, version, grad);
    if (has_prev_) board_.put_send(MessageKind::gradient, step, mb, std::move(out));
    // The microbatch's graph is gone: its received tensors' slots may be reused.
    board_.release(MessageKind::activation, step, mb);
    board_.release(MessageKind::gradient, step, mb);
  }
  void optimizer_step(int step, int new_version) override {
    py::gil_scoped_acquire gil;
    optimizer_step_(step, new_version);
  }

 private:
  py::object forward_, backward_, optimizer_step_;
  MessageBoard& board_;
  bool has_prev_, has_next_;
};

// A transport written in Python (torch.distributed): post_send/post_recv(kind, step, microbatch,
// peer, tensor) -> int, test(request) -> bool, wait(request, timeout_s). Tensors come from the board.
class PyTransport final : public Transport {
 public:
  PyTransport(py::object transport, MessageBoard& board) : transport_(std::move(transport)), board_(board) {}
  Request post_send(const MessageKey& key) override {
    py::gil_scoped_acquire gil;
    py::object tensor = board_.take_send_object(key.kind, key.step, key.microbatch);
    return call_post("post_send", key, tensor);
  }
  Request post_recv(const MessageKey& key) override {
    py::gil_scoped_acquire gil;
    py::object tensor = board_.claim_recv_object(key.kind, key.step, key.microbatch);
    return call_post("post_recv", key, tensor);
  }
  bool test(Request request) override {
    py::gil_scoped_acquire gil;
    return transport_.attr("test")(request).cast<bool>();
  }
  void wait(Request request, double timeout_s) override {
    py::gil_scoped_acquire gil;
    transport_.attr("wait")(request, timeout_s);
  }

 private:
  Request call_post(const char* name, const MessageKey& key, const py::object& tensor) {
    return transport_.attr(name)(static_cast<int>(key.kind), key.step, key.microbatch, key.peer, tensor)
        .cast<Request>();
  }
  py::object transport_;
  MessageBoard& board_;
};

MessageKind message_kind(int kind) {
  ASYNCPP_ARG_CHECK(kind == 0 || kind == 1, "kind must be 0 (activation) or 1 (gradient), got ", kind);
  return static_cast<MessageKind>(kind);
}

}  // namespace

core::ExecutorOptions executor_options(int recv_ahead, int max_inflight_sends, double timeout_s,
                                       const py::object& progress) {
  core::ExecutorOptions options{recv_ahead, max_inflight_sends, timeout_s, nullptr};
  if (!progress.is_none()) {
    ASYNCPP_ARG_CHECK(py::isinstance<core::Progress>(progress), "progress must be an asyncpp Progress or None");
    options.progress = &progress.cast<core::Progress&>();
  }
  return options;
}

static py::tuple instruction_tuple(const core::Instruction& ins) {
  return py::make_tuple(core::op_name(ins.op), ins.step, ins.microbatch, ins.version);
}

py::list run_stage_program(const std::string& schedule, int stages, int microbatches, int steps, int stage,
                           int first_step, py::object host, MessageBoard& board, Transport& transport,
                           const core::ExecutorOptions& options) {
  auto program = core::segment_program(core::parse_schedule_kind(schedule), stages, microbatches, steps, stage,
                                       first_step);
  PyStageHost py_host(std::move(host), board, stage > 0, stage < stages - 1);
  core::Executor executor(stage, std::move(program), py_host, transport, options);
  {
    py::gil_scoped_release release;
    executor.run();
  }
  py::list trace;
  for (const auto& ev : executor.trace())
    trace.append(py::make_tuple(core::op_name(ev.op), ev.step, ev.microbatch, ev.version, ev.start_ns, ev.end_ns));
  return trace;
}

void bind_runtime(py::module_& m) {
  m.def(
      "segment_program",
      [](const std::string& schedule, int stages, int microbatches, int steps, int stage, int first_step) {
        py::list out;
        for (const auto& ins : core::segment_program(core::parse_schedule_kind(schedule), stages,
                                                     microbatches, steps, stage, first_step))
          out.append(py::make_tuple(core::op_name(ins.op), ins.step, ins.microbatch, ins.version, ins.peer));
        return out;
      },
      py::arg("schedule"), py::arg("stages"), py::arg("microbatches"), py::arg("steps"), py::arg("stage"),
      py::arg("first_step") = 0,
      "Stage `stage`'s instructions for global steps [first_step, first_step+steps) as tuples "
      "(op, step, microbatch, version, peer).");

  m.def(
      "run_stage",
      [](const std::string& schedule, int stages, int microbatches, int steps, int stage, int first_step,
         py::object host, MessageBoard& board, py::object transport, int recv_ahead, int max_inflight_sends,
         double timeout_s, py::object progress) {
        PyTransport py_transport(transport, board);
        return run_stage_program(schedule, stages, microbatches, steps, stage, first_step, std::move(host), board,
                                 py_transport, executor_options(recv_ahead, max_inflight_sends, timeout_s, progress));
      },
      py::arg("schedule"), py::arg("stages"), py::arg("microbatches"), py::arg("steps"), py::arg("stage"),
      py::arg("first_step"), py::arg("host"), py::arg("board"), py::arg("transport"), py::arg("recv_ahead") = 2,
      py::arg("max_inflight_sends") = 8, py::arg("timeout_s") = 300.0, py::arg("progress") = py::none(),
      "Execute stage `stage`'s program for global steps [first_step, first_step+steps). `host` has "
      "forward/backward(step, microbatch, version, received) -> tensor to send (received and the "
      "result are None on the pipeline's ends) and optimizer_step(step, new_version); `board` is the "
      "MessageBoard of `host`; `transport` has post_send/post_recv(kind, step, microbatch, peer, tensor) "
      "-> int, test(req) -> bool and wait(req, timeout_s); `progress` (a Progress, optional) shows "
      "another thread the instruction in flight. Returns the trace as (op, step, microbatch, "
      "version, start_ns, end_ns).");

  py::class_<core::Progress>(m, "Progress",
                             "What a running stage executor is doing, for the watchdog thread: pass it "
                             "to run_stage and read snapshot() from any thread.")
      .def(py::init<>())
      .def("snapshot", [](const core::Progress& p) {
             const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now().time_since_epoch()).count();
             core::Progress::Snapshot s;
             {
               py::gil_scoped_release release;  // the executor may hold the lock for a moment
               s = p.snapshot(now);
             }
             py::dict out;
             out["completed"] = s.completed;
             out["current"] = s.running ? py::object(instruction_tuple(s.current)) : py::none();
             out["current_for_s"] = s.current_for_s;
             out["last_done"] = s.has_last ? py::object(instruction_tuple(s.last_done)) : py::none();
             return out;
           },
           "{'completed': instructions finished so far, 'current': (op, step, microbatch, version) "
           "running now or None, 'current_for_s': its running time, 'last_done': the last finished "
           "instruction's tuple or None}. optimizer_step tuples carry microbatch -1 and the new version.");

  py::class_<MessageBoard>(m, "MessageBoard",
                           "Boundary tensors between a stage host and its transport: sends returned by "
                           "forward/backward, receive slots allocated once through "
                           "host.new_recv_buffer(kind) and reused.")
      .def(py::init<py::object>(), py::arg("host"))
      .def("slot_count", [](const MessageBoard& b, int kind) { return b.slot_count(message_kind(kind)); },
           py::arg("kind"), "Receive slots allocated so far for `kind` (0 activation, 1 gradient).")
      .def("send_hold_count", &MessageBoard::send_hold_count,
           "Holds allocated so far for tensors being sent (a pool: it stops growing once the pipeline is full).")
      .def("put_send", [](MessageBoard& b, int kind, int step, int mb, py::object tensor) {
             b.put_send(message_kind(kind), step, mb, std::move(tensor));
           }, py::arg("kind"), py::arg("step"), py::arg("microbatch"), py::arg("tensor"),
           "Hold `tensor` as the payload of the send of (kind, step, microbatch) (what the runtime "
           "does with forward/backward's result).")
      .def("received", [](const MessageBoard& b, int kind, int step, int mb) {
             return b.received(message_kind(kind), step, mb);
           }, py::arg("kind"), py::arg("step"), py::arg("microbatch"),
           "The slot tensor the receive of (kind, step, microbatch) landed in.")
      .def("release", [](MessageBoard& b, int kind, int step, int mb) { b.release(message_kind(kind), step, mb); },
           py::arg("kind"), py::arg("step"), py::arg("microbatch"),
           "Free the slot of (kind, step, microbatch) for later receives.");
}

}  // namespace asyncpp::bindings
