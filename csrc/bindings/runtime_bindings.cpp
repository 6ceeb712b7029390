#include "bindings/bindings.h"

namespace asyncpp::bindings {
void bind_runtime(pybind11::module_& /*m*/) {}
}  // namespace asyncpp::bindings
