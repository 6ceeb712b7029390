#include "bindings/bindings.h"

namespace asyncpp::bindings {
void bind_schedule(pybind11::module_& /*m*/) {}
}  // namespace asyncpp::bindings
