// Counters in memory that several processes map (the ipc transport's control block, see
// asyncpp_ext/pipeline/ipc.py): one process stores a message count with release order after
// writing a slot, its peer loads it with acquire order before reading that slot, so the slot's
// bytes (or the CUDA event recorded for them) are visible to the reader on any CPU architecture.
#include <cstdint>

#include "bindings/bindings.h"
#include "core/error.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {

int64_t* counter_at(uintptr_t address) {
  ASYNCPP_ARG_CHECK(address != 0 && address % alignof(int64_t) == 0, "address must be a non-null, 8-byte "
                    "aligned address of an int64 counter, got ", address);
  return reinterpret_cast<int64_t*>(address);
}

}  // namespace

void bind_shared_counters(py::module_& m) {
  m.def("counter_load", [](uintptr_t address) { return __atomic_load_n(counter_at(address), __ATOMIC_ACQUIRE); },
        py::arg("address"),
        "The int64 at ``address`` (shared memory), read with acquire order.");
  m.def("counter_store", [](uintptr_t address, int64_t value) {
          __atomic_store_n(counter_at(address), value, __ATOMIC_RELEASE);
        },
        py::arg("address"), py::arg("value"),
        "Store ``value`` into the int64 at ``address`` (shared memory) with release order.");
}

}  // namespace asyncpp::bindings
