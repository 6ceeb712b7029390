// The socket transport's Python face: the listener a stage opens before the rendezvous, the
// transport (buffers from the stage host's MessageBoard), and run_stage_socket, which drives the
// executor with it. Calls that block release the GIL.
#include <pybind11/stl.h>

#include <memory>

#include "bindings/bindings.h"
#include "bindings/message_board.h"
#include "bindings/stage_runner.h"
#include "bindings/transport_methods.h"
#include "core/error.h"
#include "socket/socket_transport.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {

std::vector<sock::ChannelSpec> parse_channels(const std::vector<py::tuple>& channels) {
  std::vector<sock::ChannelSpec> out;
  for (size_t i = 0; i < channels.size(); ++i) {
    const py::tuple& t = channels[i];
    ASYNCPP_ARG_CHECK(t.size() == 6, "channels[", i, "] must be (kind, is_send, peer_stage, peer_rank, host, "
                      "port), got ", t.size(), " items");
    const int kind = t[0].cast<int>();
    ASYNCPP_ARG_CHECK(kind == 0 || kind == 1, "channels[", i, "]: kind must be 0 (activation) or 1 (gradient), "
                      "got ", kind);
    out.push_back(sock::ChannelSpec{static_cast<core::MessageKind>(kind), t[1].cast<bool>(), t[2].cast<int>(),
                                    t[3].cast<int>(), t[4].cast<std::string>(), t[5].cast<int>()});
  }
  return out;
}

// Keeps the board alive as long as the transport that takes buffers from it.
class PySocketTransport {
 public:
  PySocketTransport(int stage, const sock::Listener& listener, const std::vector<py::tuple>& channels,
                    uint64_t token, double connect_timeout_s, py::object board, int64_t recv_spin_us,
                    int64_t inline_recv_bytes)
      : stage_(stage), board_object_(board) {
    auto specs = parse_channels(channels);
    ASYNCPP_ARG_CHECK(py::isinstance<MessageBoard>(board), "board must be the stage host's MessageBoard "
                      "(asyncpp_ext._C.MessageBoard(host)), got ", std::string(py::str(py::type::of(board))));
    MessageBoard& buffers = board.cast<MessageBoard&>();
    py::gil_scoped_release release;  // connecting waits for the neighbours
    transport_ = std::make_unique<sock::SocketTransport>(stage, listener, std::move(specs), token,
                                                         connect_timeout_s, buffers, recv_spin_us,
                                                         inline_recv_bytes);
  }
  ~PySocketTransport() {
    py::gil_scoped_release release;  // joins the progress thread
    transport_.reset();
  }
  int stage() const { return stage_; }
  sock::SocketTransport& get() { return *transport_; }
  MessageBoard& board() { return board_object_.cast<MessageBoard&>(); }

 private:
  int stage_;
  py::object board_object_;  // declared first: destroyed after the transport
  std::unique_ptr<sock::SocketTransport> transport_;
};

}  // namespace

void bind_socket(py::module_& m) {
  py::class_<sock::Listener>(m, "SocketListener", "A listening TCP socket on a port the OS picks.")
      .def(py::init<const std::string&>(), py::arg("bind_host"),
           "bind_host: an IPv4 address (0.0.0.0 for every interface, 127.0.0.1 for this machine only).")
      .def_property_readonly("port", &sock::Listener::port);

  auto transport = py::class_<PySocketTransport>(m, "SocketTransport",
                                "Boundary messages over TCP: one connection per neighbour and direction, "
                                "moved by a progress thread (CPU tensors).")
      .def(py::init<int, const sock::Listener&, const std::vector<py::tuple>&, uint64_t, double, py::object,
                    int64_t, int64_t>(),
           py::arg("stage"), py::arg("listener"), py::arg("channels"), py::arg("token"),
           py::arg("connect_timeout_s"), py::arg("board"), py::arg("recv_spin_us") = 0,
           py::arg("inline_recv_bytes") = sock::kDefaultInlineRecvBytes,
           "channels: list of (kind 0=activation/1=gradient, is_send, peer_stage, peer_rank, host, port), "
           "host/port being the receiver's listener (used by senders); token: a number identifying the run; "
           "board: the stage host's MessageBoard; recv_spin_us: microseconds a waited-for receive polls its "
           "socket before it blocks (0 to 1e6); inline_recv_bytes: receives up to this payload size are read "
           "only by the waiting executor thread, never handed to the progress thread (0: none). Blocks until every "
           "channel is connected.")
      .def_property_readonly("stage", &PySocketTransport::stage)
      .def("close", [](PySocketTransport& t) {
             sock::SocketTransport& impl = t.get();
             py::gil_scoped_release release;
             impl.close();
           }, "Stop the progress thread and close the connections.");
  def_transport_requests<PySocketTransport>(transport);

  m.def(
      "run_stage_socket",
      [](const std::string& schedule, int stages, int microbatches, int steps, int stage, int first_step,
         py::object host, PySocketTransport& transport, int recv_ahead, int max_inflight_sends, double timeout_s,
         py::object progress) {
        ASYNCPP_ARG_CHECK(transport.stage() == stage, "the socket transport was created for stage ",
                          transport.stage(), " but run_stage_socket was asked to run stage ", stage);
        return run_stage_program(schedule, stages, microbatches, steps, stage, first_step, std::move(host),
                                 transport.board(), transport.get(),
                                 executor_options(recv_ahead, max_inflight_sends, timeout_s, progress));
      },
      py::arg("schedule"), py::arg("stages"), py::arg("microbatches"), py::arg("steps"), py::arg("stage"),
      py::arg("first_step"), py::arg("host"), py::arg("transport"), py::arg("recv_ahead") = 2,
      py::arg("max_inflight_sends") = 8, py::arg("timeout_s") = 300.0, py::arg("progress") = py::none(),
      "run_stage with the C++ socket transport: same arguments and trace; `transport` is a SocketTransport "
      "whose board is `host`'s.");
}

}  // namespace asyncpp::bindings
