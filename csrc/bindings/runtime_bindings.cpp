// The runtime's Python face: run one stage's program with a Python stage host and a Python
// transport (gloo via torch.distributed). The executor runs with the GIL released; it takes the
// GIL only to call back into Python.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "bindings/stage_runner.h"
#include "core/executor.h"
#include "core/segment.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {

using core::MessageKey;
using core::Transport;

class PyStageHost final : public core::StageHost {
 public:
  explicit PyStageHost(py::object host) : host_(std::move(host)) {}
  void forward(int step, int mb, int version) override { call("forward", step, mb, version); }
  void backward(int step, int mb, int version) override { call("backward", step, mb, version); }
  void optimizer_step(int step, int new_version) override { call("optimizer_step", step, new_version); }

 private:
  template <typename... Args>
  void call(const char* name, Args... args) {
    py::gil_scoped_acquire gil;
    host_.attr(name)(args...);
  }
  py::object host_;
};

class PyTransport final : public Transport {
 public:
  explicit PyTransport(py::object transport) : transport_(std::move(transport)) {}
  Request post_send(const MessageKey& key) override { return post("post_send", key); }
  Request post_recv(const MessageKey& key) override { return post("post_recv", key); }
  bool test(Request request) override {
    py::gil_scoped_acquire gil;
    return transport_.attr("test")(request).cast<bool>();
  }
  void wait(Request request, double timeout_s) override {
    py::gil_scoped_acquire gil;
    transport_.attr("wait")(request, timeout_s);
  }

 private:
  Request post(const char* name, const MessageKey& key) {
    py::gil_scoped_acquire gil;
    return transport_.attr(name)(static_cast<int>(key.kind), key.step, key.microbatch, key.peer)
        .cast<Request>();
  }
  py::object transport_;
};

}  // namespace

py::list run_stage_program(const std::string& schedule, int stages, int microbatches, int steps, int stage,
                           int first_step, py::object host, Transport& transport,
                           const core::ExecutorOptions& options) {
  auto program = core::segment_program(core::parse_schedule_kind(schedule), stages, microbatches, steps, stage,
                                       first_step);
  PyStageHost py_host(std::move(host));
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
         py::object host, py::object transport, int recv_ahead, int max_inflight_sends, double timeout_s) {
        PyTransport py_transport(transport);
        return run_stage_program(schedule, stages, microbatches, steps, stage, first_step, std::move(host),
                                 py_transport, core::ExecutorOptions{recv_ahead, max_inflight_sends, timeout_s});
      },
      py::arg("schedule"), py::arg("stages"), py::arg("microbatches"), py::arg("steps"), py::arg("stage"),
      py::arg("first_step"), py::arg("host"), py::arg("transport"), py::arg("recv_ahead") = 2,
      py::arg("max_inflight_sends") = 8, py::arg("timeout_s") = 300.0,
      "Execute stage `stage`'s program for global steps [first_step, first_step+steps). `host` has "
      "forward/backward(step, microbatch, version) and optimizer_step(step, new_version); `transport` "
      "has post_send/post_recv(kind, step, microbatch, peer) -> int, test(req) -> bool and "
      "wait(req, timeout_s). Returns the trace as (op, step, microbatch, version, start_ns, end_ns).");
}

}  // namespace asyncpp::bindings
