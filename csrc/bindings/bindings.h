// Each area of the module registers its functions from its own file; module.cpp calls them all.
#pragma once
#include <pybind11/pybind11.h>

namespace asyncpp::bindings {
void bind_build_info(pybind11::module_& m);  // build_info.cpp
void bind_schedule(pybind11::module_& m);    // schedule_bindings.cpp
void bind_optim(pybind11::module_& m);       // optim_bindings.cpp
void bind_runtime(pybind11::module_& m);     // runtime_bindings.cpp
void bind_nccl(pybind11::module_& m);        // nccl_bindings.cpp
void bind_socket(pybind11::module_& m);      // socket_bindings.cpp
void bind_shared_counters(pybind11::module_& m);  // shared_counter_bindings.cpp
}  // namespace asyncpp::bindings
