// The one pybind11 module, asyncpp_ext._C. C++ exceptions map to Python as:
// asyncpp::ArgumentError -> ValueError, asyncpp::Error -> RuntimeError.
#include "bindings/bindings.h"
#include "core/error.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "asyncpp C++/CUDA core (torch-free; tensors cross as DLPack capsules)";
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const asyncpp::ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  using namespace asyncpp::bindings;
  bind_build_info(m);
  bind_schedule(m);
  bind_optim(m);
  bind_runtime(m);
  bind_nccl(m);
  bind_socket(m);
  bind_shared_counters(m);
}
