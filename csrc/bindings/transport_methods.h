// The request methods every C++ transport's Python class shares (post, test, wait, pending), bound
// once here for the socket and NCCL transports alike.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "core/error.h"
#include "core/transport.h"

namespace asyncpp::bindings {

inline core::MessageKey message_key(int kind, int step, int microbatch, int peer) {
  ASYNCPP_ARG_CHECK(kind == 0 || kind == 1, "kind must be 0 (activation) or 1 (gradient), got ", kind);
  return core::MessageKey{static_cast<core::MessageKind>(kind), step, microbatch, peer};
}

// Binds the request methods on `cls`, a class wrapping a transport: `Wrapper::get()` returns it.
// test and wait release the GIL: a wait blocks, and an NCCL test queries the device.
template <class Wrapper, class Class>
void def_transport_requests(Class& cls) {
  namespace py = pybind11;
  cls.def("post_send", [](Wrapper& t, int kind, int step, int mb, int peer) {
         return t.get().post_send(message_key(kind, step, mb, peer));
       }, py::arg("kind"), py::arg("step"), py::arg("microbatch"), py::arg("peer"),
       "Send the board's tensor for (kind, step, microbatch) to stage `peer`.")
      .def("post_recv", [](Wrapper& t, int kind, int step, int mb, int peer) {
         return t.get().post_recv(message_key(kind, step, mb, peer));
       }, py::arg("kind"), py::arg("step"), py::arg("microbatch"), py::arg("peer"),
       "Receive (kind, step, microbatch) from stage `peer` into a board slot.")
      .def("test", [](Wrapper& t, int64_t request) {
         auto& impl = t.get();
         py::gil_scoped_release release;
         return impl.test(request);
       }, py::arg("request"), "True once the request has completed (it is then retired); raises its failure.")
      .def("wait", [](Wrapper& t, int64_t request, double timeout_s) {
         auto& impl = t.get();
         py::gil_scoped_release release;
         impl.wait(request, timeout_s);
       }, py::arg("request"), py::arg("timeout_s"), "Block until the request completes; raises its failure.")
      .def("cancel", [](Wrapper& t, const std::string& reason) {
         auto& impl = t.get();
         py::gil_scoped_release release;
         impl.cancel(reason);
       }, py::arg("reason"),
       "From another thread: end the run -- the wait in progress and every later request fail with `reason`.")
      .def("pending", [](Wrapper& t) { return t.get().pending(); }, "How many posted requests are unretired.")
      .def("pending_descriptions", [](Wrapper& t) { return t.get().pending_descriptions(); },
           "What each posted, unfinished transfer is; safe from another thread (the watchdog).");
}

}  // namespace asyncpp::bindings
