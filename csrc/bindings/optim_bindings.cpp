#include "bindings/bindings.h"

namespace asyncpp::bindings {
void bind_optim(pybind11::module_& /*m*/) {}
}  // namespace asyncpp::bindings
