// The NCCL transport's Python face: unique ids for the rendezvous, the transport object (buffers
// come from the stage host's MessageBoard), and run_stage_nccl,
// which drives the executor with it. Blocking calls release the GIL.
//
// The class is bound in every build so that its argument checks behave the same everywhere; in a
// build without CUDA, creating one fails with a message saying to rebuild with nvcc available.
#include <pybind11/stl.h>

#include <cstring>
#include <memory>

#include "bindings/bindings.h"
#include "bindings/stage_runner.h"
#include "bindings/transport_methods.h"
#include "bindings/tensor_args.h"
#include "core/error.h"
#include "nccl/nccl_selftest.h"
#include "nccl/nccl_transport.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {

using core::MessageKind;

std::vector<nccl::ChannelSpec> parse_channels(const std::vector<py::tuple>& channels) {
  std::vector<nccl::ChannelSpec> out;
  for (size_t i = 0; i < channels.size(); ++i) {
    const py::tuple& t = channels[i];
    ASYNCPP_ARG_CHECK(t.size() == 5, "channels[", i, "] must be (kind, is_send, peer_stage, peer_rank, "
                      "unique_id), got ", t.size(), " items");
    nccl::ChannelSpec c{};
    const int kind = t[0].cast<int>();
    ASYNCPP_ARG_CHECK(kind == 0 || kind == 1, "channels[", i, "]: kind must be 0 (activation) or 1 (gradient), "
                      "got ", kind);
    c.kind = static_cast<MessageKind>(kind);
    c.is_send = t[1].cast<bool>();
    c.peer = t[2].cast<int>();
    c.peer_rank = t[3].cast<int>();
    ASYNCPP_ARG_CHECK(py::isinstance<py::bytes>(t[4]), "channels[", i, "]: unique_id must be bytes (from "
                      "nccl_unique_id()), got ", std::string(py::str(py::type::of(t[4]))));
    const std::string id = t[4].cast<std::string>();
    ASYNCPP_ARG_CHECK(id.size() == sizeof(c.id.internal), "channels[", i, "]: unique_id must be ",
                      sizeof(c.id.internal), " bytes (an NCCL unique id), got ", id.size());
    std::memcpy(c.id.internal, id.data(), id.size());
    out.push_back(c);
  }
  return out;
}

// Self-test cases from Python: (dtype label, element size in bytes, element count), each checked.
std::vector<nccl::SelfTestCase> parse_self_test_cases(const std::vector<py::tuple>& cases) {
  ASYNCPP_ARG_CHECK(!cases.empty(), "cases must list at least one (dtype, element_size, count)");
  std::vector<nccl::SelfTestCase> out;
  for (size_t i = 0; i < cases.size(); ++i) {
    const py::tuple& t = cases[i];
    ASYNCPP_ARG_CHECK(t.size() == 3, "cases[", i, "] must be (dtype, element_size, count), got ", t.size(),
                      " items");
    nccl::SelfTestCase c{t[0].cast<std::string>(), t[1].cast<int>(), t[2].cast<int64_t>()};
    ASYNCPP_ARG_CHECK(c.element_size == 1 || c.element_size == 2 || c.element_size == 4 || c.element_size == 8,
                      "cases[", i, "]: element_size must be 1, 2, 4 or 8 bytes, got ", c.element_size);
    ASYNCPP_ARG_CHECK(c.count >= 1 && c.count <= (int64_t{1} << 30) / c.element_size, "cases[", i,
                      "]: count must be in [1, 1 GiB / element_size], got ", c.count);
    out.push_back(std::move(c));
  }
  return out;
}

#ifdef ASYNCPP_WITH_CUDA
py::dict outcome_dict(const nccl::SelfTestOutcome& o) {
  py::dict d;
  d["dtype"] = o.what.dtype;
  d["count"] = o.what.count;
  d["bytes"] = o.bytes;
  d["mismatches"] = o.mismatches;
  d["seconds"] = o.seconds;
  return d;
}
#endif

// The Python-visible transport: keeps the board alive and (with CUDA) owns the C++ transport.
class PyNcclTransport {
 public:
  PyNcclTransport(int stage, int device, std::uintptr_t compute_stream, const std::vector<py::tuple>& channels,
                  py::object board)
      : stage_(stage), device_(device), board_object_(board) {
    auto specs = parse_channels(channels);
    nccl::validate_channels(stage, specs);
    ASYNCPP_ARG_CHECK(py::isinstance<MessageBoard>(board), "board must be the stage host's MessageBoard "
                      "(asyncpp_ext._C.MessageBoard(host)), got ", std::string(py::str(py::type::of(board))));
    MessageBoard& buffers = board.cast<MessageBoard&>();
#ifdef ASYNCPP_WITH_CUDA
    py::gil_scoped_release release;  // communicator creation blocks until every peer has joined
    transport_ = std::make_unique<nccl::NcclTransport>(stage, device, compute_stream, std::move(specs), buffers);
#else
    (void)compute_stream;
    (void)buffers;
    ASYNCPP_CHECK(false, "asyncpp_ext was built without CUDA, so the NCCL transport is not available: "
                  "rebuild with nvcc on PATH (pip install . with ASYNCPP_CUDA=auto or on), or use the gloo "
                  "transport on CPU");
#endif
  }
#ifdef ASYNCPP_WITH_CUDA
  ~PyNcclTransport() {
    py::gil_scoped_release release;  // close() may wait for transfers; buffer release takes the GIL
    transport_.reset();
  }
  nccl::NcclTransport& get() { return *transport_; }
#endif
  int stage() const { return stage_; }
  int device() const { return device_; }
  MessageBoard& board() { return board_object_.cast<MessageBoard&>(); }

 private:
  int stage_;
  int device_;
  py::object board_object_;  // declared first: destroyed after the transport
#ifdef ASYNCPP_WITH_CUDA
  std::unique_ptr<nccl::NcclTransport> transport_;
#endif
};

}  // namespace

void bind_nccl(py::module_& m) {
  m.def(
      "nccl_unique_id",
      [] {
        nccl::UniqueId id = nccl::new_unique_id();
        return py::bytes(id.internal, sizeof(id.internal));
      },
      "A new NCCL unique id (128 bytes) for one communicator; NCCL must be loaded (nccl_load).");

  m.def(
      "nccl_self_test",
      [](int device, const std::vector<py::tuple>& cases, double spin_ms) {
        ASYNCPP_ARG_CHECK(device >= 0, "device must be a CUDA device index >= 0, got ", device);
        ASYNCPP_ARG_CHECK(spin_ms >= 0 && spin_ms <= 1000, "spin_ms must be in [0, 1000], got ", spin_ms);
        auto parsed = parse_self_test_cases(cases);
#ifdef ASYNCPP_WITH_CUDA
        nccl::SelfTestReport r;
        {
          py::gil_scoped_release release;
          r = nccl::self_test(device, parsed, spin_ms);
        }
        py::dict d;
        d["device"] = r.device;
        py::list out;
        for (const auto& o : r.cases) out.append(outcome_dict(o));
        d["cases"] = out;
        d["ordering"] = outcome_dict(r.ordering);
        d["spin_ms"] = r.spin_ms;
        return d;
#else
        (void)parsed;
        ASYNCPP_CHECK(false, "asyncpp_ext was built without CUDA, so the NCCL self-test cannot run: rebuild "
                      "with nvcc on PATH (pip install . with ASYNCPP_CUDA=auto or on)");
        return py::dict();
#endif
      },
      py::arg("device"), py::arg("cases"), py::arg("spin_ms") = 20.0,
      "One GPU sends to itself over a 1-rank NCCL communicator through the transport's ordering "
      "sequence; per case (dtype, element_size, count) the mismatching bytes (0 = bit-exact), plus an "
      "'ordering' case whose producer kernel is delayed spin_ms on the GPU. NCCL must be loaded.");

  auto cls = py::class_<PyNcclTransport>(m, "NcclTransport",
                              "Boundary messages over NCCL: one 2-rank communicator per neighbour and "
                              "direction, each on its own CUDA stream.")
      .def(py::init<int, int, std::uintptr_t, const std::vector<py::tuple>&, py::object>(), py::arg("stage"),
           py::arg("device"), py::arg("compute_stream"), py::arg("channels"), py::arg("board"),
           "channels: list of (kind 0=activation/1=gradient, is_send, peer_stage, peer_rank, unique_id "
           "bytes); board: the stage host's MessageBoard (its tensors are contiguous CUDA tensors on "
           "`device`); compute_stream: torch.cuda.Stream.cuda_stream. Blocks "
           "until every peer has created its side.")
      .def_property_readonly("stage", &PyNcclTransport::stage)
      .def_property_readonly("device", &PyNcclTransport::device);
#ifdef ASYNCPP_WITH_CUDA
  // Without CUDA no instance can exist (the constructor fails), so only CUDA builds need these.
  def_transport_requests<PyNcclTransport>(cls);
  cls.def("close", [](PyNcclTransport& t, double timeout_s) {
         nccl::NcclTransport& impl = t.get();
         py::gil_scoped_release release;
         impl.close(timeout_s);
       }, py::arg("timeout_s") = 30.0,
       "Wait for in-flight transfers (up to timeout_s) and destroy the communicators; aborts them "
       "instead if a transfer is still incomplete.");

  m.def(
      "run_stage_nccl",
      [](const std::string& schedule, int stages, int microbatches, int steps, int stage, int first_step,
         py::object host, PyNcclTransport& transport, int recv_ahead, int max_inflight_sends, double timeout_s,
         py::object progress) {
        ASYNCPP_ARG_CHECK(transport.stage() == stage, "the NCCL transport was created for stage ",
                          transport.stage(), " but run_stage_nccl was asked to run stage ", stage);
        return run_stage_program(schedule, stages, microbatches, steps, stage, first_step, std::move(host),
                                 transport.board(), transport.get(), executor_options(recv_ahead, max_inflight_sends, timeout_s, progress));
      },
      py::arg("schedule"), py::arg("stages"), py::arg("microbatches"), py::arg("steps"), py::arg("stage"),
      py::arg("first_step"), py::arg("host"), py::arg("transport"), py::arg("recv_ahead") = 2,
      py::arg("max_inflight_sends") = 8, py::arg("timeout_s") = 300.0, py::arg("progress") = py::none(),
      "run_stage with the C++ NCCL transport: same arguments and trace; `transport` is an NcclTransport "
      "whose board is `host`'s.");
#endif
}

}  // namespace asyncpp::bindings
