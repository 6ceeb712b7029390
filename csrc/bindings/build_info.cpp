#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "build_config.h"
#include "kernels/cpu_isa.h"
#include "kernels/device.h"
#include "nccl/nccl_loader.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {
std::vector<std::string> isa_names(const std::vector<kernels::CpuIsa>& isas) {
  std::vector<std::string> names;
  for (kernels::CpuIsa isa : isas) names.emplace_back(kernels::cpu_isa_name(isa));
  return names;
}
}  // namespace

void bind_build_info(py::module_& m) {
  m.def("build_config", [] {
    py::dict d;
    d["version"] = ASYNCPP_VERSION_STR;
    d["cxx_compiler"] = ASYNCPP_CXX_COMPILER_STR;
    d["build_type"] = ASYNCPP_BUILD_TYPE_STR;
    d["cuda_mode"] = ASYNCPP_CUDA_MODE_STR;
#ifdef ASYNCPP_WITH_CUDA
    d["cuda_compiled"] = true;
#else
    d["cuda_compiled"] = false;
#endif
    d["cuda_archs"] = std::string(ASYNCPP_CUDA_ARCHS);
    d["nvcc_version"] = ASYNCPP_CUDA_COMPILER_VERSION_STR;
    d["openmp"] = std::string(ASYNCPP_OPENMP_FOUND_STR) == "TRUE";
    d["cpu_threads"] = kernels::cpu_threads();
    const kernels::CpuIsaSelection& isa = kernels::cpu_isa_selection();
    if (isa.ok) {
      d["cpu_kernel_isa"] = kernels::cpu_isa_name(isa.isa);
      d["cpu_kernel_isa_reason"] = isa.reason;
    } else {  // reported, not raised: the kernels raise it when they run
      d["cpu_kernel_isa"] = py::none();
      d["cpu_kernel_isa_reason"] = py::none();
      d["cpu_kernel_isa_error"] = isa.error;
    }
    d["cpu_kernel_isas_built"] = isa_names(isa.built);
    d["cpu_kernel_isas_runnable"] = isa_names(isa.runnable);
    return d;
  }, "Facts fixed at build time: compiler, CUDA archs, OpenMP; the CPU kernels' ISA and why.");
  m.def("cpu_kernel_isa_check", [] { return kernels::cpu_isa_name(kernels::cpu_kernel_isa()); },
        "The ISA the CPU optimizer kernels run with; raises ValueError when $ASYNCPP_CPU_ISA "
        "cannot be honoured here (what their first call would raise).");
  m.def("cuda_device_count", &kernels::cuda_device_count,
        "CUDA devices visible to the CUDA runtime (0 without CUDA kernels or without a GPU).");
  m.def("cuda_status", &kernels::cuda_status);
  m.def("nccl_load", [](const std::vector<std::string>& candidates) {
    nccl::LoadResult r;
    {
      py::gil_scoped_release release;
      r = nccl::load(candidates);
    }
    py::dict d;
    d["ok"] = r.ok;
    d["path"] = r.path;
    d["version"] = r.version;
    d["error"] = r.error;
    return d;
  }, py::arg("candidates"), "Load libnccl from the first loadable candidate path.");
}

}  // namespace asyncpp::bindings
