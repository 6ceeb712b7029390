// Python entry points of the fused optimizer kernels. This file is the ONE place that checks the
// arguments (device, dtype, shapes, contiguity, list lengths, hyperparameters); the kernels trust
// what they get. Every call releases the GIL while the kernel runs.
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/tensor_args.h"
#include "core/error.h"
#include "kernels/cublas_wgrad.h"
#include "kernels/optim_kernels.h"

namespace py = pybind11;

namespace asyncpp::bindings {
namespace {
using namespace asyncpp::kernels::optim;

std::string item(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

#ifndef ASYNCPP_WITH_CUDA
// CUDA tensors reached a build without CUDA kernels: one message for every entry point.
[[noreturn]] void no_cuda_kernels(const char* what) {
  ASYNCPP_ARG_CHECK(false, what, " are CUDA tensors but asyncpp_ext was built without CUDA kernels; "
                    "rebuild with nvcc available (ASYNCPP_CUDA=on) or use CPU tensors");
  std::abort();  // not reached: the check throws
}
#endif

// All tensors of one call live on one device; `first` decides which.
void expect_like(const TensorView& t, const TensorView& first, DType dtype, const std::string& name) {
  expect_device(t, first.device, name);
  ASYNCPP_ARG_CHECK(t.device_index == first.device_index, name, ": on CUDA device ", t.device_index,
                    " but the first parameter is on device ", first.device_index,
                    "; keep all tensors of one optimizer call on one device");
  expect_dtype(t, dtype, name);
  expect_contiguous(t, name);
}

void expect_len(size_t got, size_t want, const char* name, const char* ref) {
  ASYNCPP_ARG_CHECK(got == want, name, ": expected ", want, " tensors (one per entry of ", ref, "), got ", got);
}

void expect_finite_scalar(double x, const char* name) {
  ASYNCPP_ARG_CHECK(std::isfinite(x), name, " must be a finite number, got ", x);
}

// `previous` may hold None: that tensor gets no correction this step.
std::vector<std::optional<TensorView>> borrow_optional_tensors(const py::sequence& capsules,
                                                               const char* arg_name) {
  std::vector<std::optional<TensorView>> out;
  out.reserve(py::len(capsules));
  size_t i = 0;
  for (const auto& c : capsules) {
    const std::string name = item(arg_name, i++);
    out.push_back(c.is_none() ? std::nullopt : std::optional<TensorView>(borrow_tensor(c, name.c_str())));
  }
  return out;
}

// The EF mode of each tensor. E comes from one place: ef_bufs (one buffer per parameter, ef_first
// picking the first-step rule) or previous (W(t-1) per parameter, None = no correction); with
// neither, EF is off and ef_beta must be 0.
std::vector<EfMode> ef_modes(const std::vector<TensorView>& efs, const std::vector<bool>& ef_first,
                             const std::vector<std::optional<TensorView>>& previous, size_t n,
                             double ef_beta) {
  expect_finite_scalar(ef_beta, "ef_beta");
  ASYNCPP_ARG_CHECK(ef_beta >= 0.0, "ef_beta must be >= 0 (0 turns error feedback off), got ", ef_beta);
  std::vector<EfMode> modes(n, EfMode::off);
  if (!previous.empty()) {
    ASYNCPP_ARG_CHECK(efs.empty(), "ef_bufs and previous were both given; error feedback takes its previous "
                      "update from one of them: pass ef_bufs=[] or previous=[]");
    ASYNCPP_ARG_CHECK(ef_first.empty(), "ef_first applies to ef_bufs only; pass ef_first=[] with previous");
    ASYNCPP_ARG_CHECK(ef_beta > 0.0, "previous was given but ef_beta is 0; pass previous=[] to turn EF off");
    expect_len(previous.size(), n, "previous", "params");
    for (size_t i = 0; i < n; ++i) modes[i] = previous[i] ? EfMode::weights : EfMode::off;
    return modes;
  }
  if (efs.empty()) {
    ASYNCPP_ARG_CHECK(ef_beta == 0.0, "ef_beta=", ef_beta, " needs one buffer in ef_bufs or one tensor in "
                      "previous per parameter; got neither (pass ef_beta=0 to turn EF off)");
    return modes;
  }
  ASYNCPP_ARG_CHECK(ef_beta > 0.0, "ef_bufs were given but ef_beta is 0; pass ef_bufs=[] to turn EF off");
  expect_len(efs.size(), n, "ef_bufs", "params");
  expect_len(ef_first.size(), n, "ef_first", "params");
  for (size_t i = 0; i < n; ++i) modes[i] = ef_first[i] ? EfMode::first : EfMode::corrected;
  return modes;
}

// W(t) (sources[i]) or W(t-1) (previous[i]) of params[i]: a float32 tensor like the parameter, and
// either the parameter's very storage (in place; 2bw's previous) or apart from it. A partial
// overlap would make one element's store feed another element's read.
void expect_version_of(const TensorView& t, const TensorView& param, const TensorView& first,
                       const std::string& name, const std::string& param_name) {
  expect_like(t, first, DType::f32, name);
  expect_same_shape(param, t, param_name, name);
  const auto a = reinterpret_cast<uintptr_t>(t.data), b = reinterpret_cast<uintptr_t>(param.data);
  const auto bytes = uintptr_t(param.nbytes());
  ASYNCPP_ARG_CHECK(a == b || a + bytes <= b || b + bytes <= a, name, " partly overlaps ", param_name,
                    "; pass the parameter itself or a tensor in memory of its own");
}

// Where params[i] reads W(t) (the parameter itself when `sources` is empty: in place) and W(t-1).
std::pair<const float*, const float*> versions_of(size_t i, const std::vector<TensorView>& params,
                                                  const std::vector<TensorView>& sources,
                                                  const std::vector<std::optional<TensorView>>& previous) {
  const std::string param_name = item("params", i);
  const float* src = params[i].ptr<float>();
  if (!sources.empty()) {
    expect_version_of(sources[i], params[i], params[0], item("sources", i), param_name);
    src = sources[i].ptr<float>();
  }
  const float* prev = nullptr;
  if (!previous.empty() && previous[i]) {
    expect_version_of(*previous[i], params[i], params[0], item("previous", i), param_name);
    prev = previous[i]->ptr<float>();
  }
  return {src, prev};
}

Storage storage_of(const TensorView& t, const std::string& name) {
  if (t.dtype == DType::f32) return Storage::f32;
  if (t.dtype == DType::bf16) return Storage::bf16;
  ASYNCPP_ARG_CHECK(false, name, ": expected float32 or bfloat16, got ", dtype_name(t.dtype));
}

// `skip`: None, or the one-element int32 tensor a nonfinite_flag call wrote, on the device of the
// call's tensors. A value >= 0 there (a NaN or Inf was found) makes the call change nothing: on
// CUDA the kernels read it as they run, so the host launches the step without waiting for the
// scan; on the CPU it is read here, the scan being done.
const int32_t* skip_flag(const py::object& skip_c, const TensorView& first) {
  if (skip_c.is_none()) return nullptr;
  const TensorView s = borrow_tensor(skip_c, "skip");
  expect_like(s, first, DType::i32, "skip");
  ASYNCPP_ARG_CHECK(s.numel() == 1, "skip: expected one int32 element (what nonfinite_flag writes), got ",
                    s.numel());
  return s.ptr<int32_t>();
}

bool skipped_on_cpu(const int32_t* skip) { return skip != nullptr && *skip >= 0; }

void adamw_step(const py::sequence& params_c, const py::sequence& grads_c, const py::sequence& exp_avgs_c,
                const py::sequence& exp_avg_sqs_c, const py::sequence& ef_c, const std::vector<int64_t>& steps,
                const std::vector<bool>& ef_first, double lr, double beta1, double beta2, double eps,
                double weight_decay, double ef_beta, intptr_t stream, const py::sequence& sources_c,
                const py::sequence& previous_c, const py::object& skip_c) {
  const auto params = borrow_tensors(params_c, "params");
  const auto sources = borrow_tensors(sources_c, "sources");
  const auto previous = borrow_optional_tensors(previous_c, "previous");
  const auto grads = borrow_tensors(grads_c, "grads");
  const auto m = borrow_tensors(exp_avgs_c, "exp_avgs");
  const auto v = borrow_tensors(exp_avg_sqs_c, "exp_avg_sqs");
  const auto ef = borrow_tensors(ef_c, "ef_bufs");
  const size_t n = params.size();
  expect_len(grads.size(), n, "grads", "params");
  expect_len(m.size(), n, "exp_avgs", "params");
  expect_len(v.size(), n, "exp_avg_sqs", "params");
  expect_len(steps.size(), n, "steps", "params");
  if (!sources.empty()) expect_len(sources.size(), n, "sources", "params");
  for (double x : {lr, beta1, beta2, eps, weight_decay}) expect_finite_scalar(x, "AdamW hyperparameters");
  ASYNCPP_ARG_CHECK(lr >= 0.0, "lr must be >= 0, got ", lr);
  ASYNCPP_ARG_CHECK(beta1 >= 0.0 && beta1 < 1.0, "beta1 must be in [0, 1), got ", beta1);
  ASYNCPP_ARG_CHECK(beta2 >= 0.0 && beta2 < 1.0, "beta2 must be in [0, 1), got ", beta2);
  ASYNCPP_ARG_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  ASYNCPP_ARG_CHECK(weight_decay >= 0.0, "weight_decay must be >= 0, got ", weight_decay);
  const auto modes = ef_modes(ef, ef_first, previous, n, ef_beta);
  if (n == 0) return;

  std::vector<AdamWTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    const TensorView& p = params[i];
    expect_like(p, params[0], DType::f32, item("params", i));
    const std::pair<const TensorView*, const char*> others[] = {
        {&grads[i], "grads"}, {&m[i], "exp_avgs"}, {&v[i], "exp_avg_sqs"}};
    for (const auto& [t, name] : others) {
      expect_like(*t, params[0], DType::f32, item(name, i));
      expect_same_shape(p, *t, item("params", i), item(name, i));
    }
    if (!ef.empty()) {
      expect_like(ef[i], params[0], DType::f32, item("ef_bufs", i));
      expect_same_shape(p, ef[i], item("params", i), item("ef_bufs", i));
    }
    ASYNCPP_ARG_CHECK(steps[i] >= 1, item("steps", i), " must be >= 1 (the step count after this update), got ",
                      steps[i]);
    // Scalars in double, rounded once to float, as torch does with Python-float scalars.
    const double bc1 = 1.0 - std::pow(beta1, double(steps[i]));
    const double bc2 = 1.0 - std::pow(beta2, double(steps[i]));
    const auto [src, prev] = versions_of(i, params, sources, previous);
    AdamWTensor& w = work[i];
    w.param = p.ptr<float>();
    w.source = src;
    w.previous = prev;
    w.grad = grads[i].ptr<float>();
    w.exp_avg = m[i].ptr<float>();
    w.exp_avg_sq = v[i].ptr<float>();
    w.ef = ef.empty() ? nullptr : ef[i].ptr<float>();
    w.numel = p.numel();
    w.s = AdamWScalars{float(1.0 - beta1), float(beta2), float(1.0 - beta2), float(eps),
                       float(-(lr / bc1)), float(std::sqrt(bc2))};
    w.neg_lr_wd = float(-(lr * weight_decay));
    w.ef_beta = float(ef_beta);
    w.ef_mode = modes[i];
  }
  const int32_t* skip = skip_flag(skip_c, params[0]);
  const bool cuda = params[0].device == DeviceKind::cuda;
  py::gil_scoped_release release;
  if (!cuda) return skipped_on_cpu(skip) ? void() : adamw_step_cpu(work);
#ifdef ASYNCPP_WITH_CUDA
  adamw_step_cuda(work, skip, stream);
#else
  (void)stream;
  no_cuda_kernels("params");
#endif
}

void muon_momentum(const py::sequence& grads_c, const py::sequence& bufs_c, const py::sequence& outs_c,
                   double momentum, bool nesterov, const py::object& sumsq_c, intptr_t stream,
                   const py::object& skip_c) {
  const auto grads = borrow_tensors(grads_c, "grads");
  const auto bufs = borrow_tensors(bufs_c, "momentum_bufs");
  const auto outs = borrow_tensors(outs_c, "outs");
  const size_t n = grads.size();
  expect_len(bufs.size(), n, "momentum_bufs", "grads");
  expect_len(outs.size(), n, "outs", "grads");
  expect_finite_scalar(momentum, "momentum");
  ASYNCPP_ARG_CHECK(momentum >= 0.0 && momentum < 1.0, "momentum must be in [0, 1), got ", momentum);
  if (n == 0) return;
  const Storage storage = storage_of(outs[0], "outs[0]");
  float* sumsq = nullptr;
  if (!sumsq_c.is_none()) {
    const TensorView s = borrow_tensor(sumsq_c, "sumsq");
    expect_like(s, grads[0], DType::f32, "sumsq");
    ASYNCPP_ARG_CHECK(s.numel() == int64_t(n), "sumsq: expected ", n, " elements (one per tensor), got ",
                      s.numel());
    sumsq = s.ptr<float>();
  }
  std::vector<MomentumTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    expect_like(grads[i], grads[0], DType::f32, item("grads", i));
    expect_like(bufs[i], grads[0], DType::f32, item("momentum_bufs", i));
    expect_like(outs[i], grads[0], outs[0].dtype, item("outs", i));
    expect_same_shape(grads[i], bufs[i], item("grads", i), item("momentum_bufs", i));
    expect_same_shape(grads[i], outs[i], item("grads", i), item("outs", i));
    work[i] = MomentumTensor{grads[i].ptr<float>(), bufs[i].ptr<float>(), outs[i].data, grads[i].numel(),
                             float(momentum), nesterov};
  }
  const int32_t* skip = skip_flag(skip_c, grads[0]);
  const bool cuda = grads[0].device == DeviceKind::cuda;
  py::gil_scoped_release release;
  if (!cuda) return skipped_on_cpu(skip) ? void() : muon_momentum_cpu(work, storage, sumsq);
#ifdef ASYNCPP_WITH_CUDA
  muon_momentum_cuda(work, storage, sumsq, skip, stream);
#else
  (void)stream;
  no_cuda_kernels("grads");
#endif
}

void apply_update(const py::sequence& params_c, const py::sequence& updates_c, const py::sequence& ef_c,
                  const std::vector<double>& update_scales, const std::vector<bool>& ef_first, double lr,
                  double weight_decay, double ef_beta, intptr_t stream, const py::sequence& sources_c,
                  const py::sequence& previous_c, const py::object& skip_c) {
  const auto params = borrow_tensors(params_c, "params");
  const auto sources = borrow_tensors(sources_c, "sources");
  const auto previous = borrow_optional_tensors(previous_c, "previous");
  const auto updates = borrow_tensors(updates_c, "updates");
  const auto ef = borrow_tensors(ef_c, "ef_bufs");
  const size_t n = params.size();
  expect_len(updates.size(), n, "updates", "params");
  expect_len(update_scales.size(), n, "update_scales", "params");
  if (!sources.empty()) expect_len(sources.size(), n, "sources", "params");
  expect_finite_scalar(lr, "lr");
  expect_finite_scalar(weight_decay, "weight_decay");
  ASYNCPP_ARG_CHECK(lr >= 0.0, "lr must be >= 0, got ", lr);
  ASYNCPP_ARG_CHECK(weight_decay >= 0.0, "weight_decay must be >= 0, got ", weight_decay);
  const auto modes = ef_modes(ef, ef_first, previous, n, ef_beta);
  if (n == 0) return;
  const Storage storage = storage_of(updates[0], "updates[0]");
  std::vector<ApplyTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    expect_like(params[i], params[0], DType::f32, item("params", i));
    expect_like(updates[i], params[0], updates[0].dtype, item("updates", i));
    expect_same_shape(params[i], updates[i], item("params", i), item("updates", i));
    if (!ef.empty()) {
      expect_like(ef[i], params[0], DType::f32, item("ef_bufs", i));
      expect_same_shape(params[i], ef[i], item("params", i), item("ef_bufs", i));
    }
    expect_finite_scalar(update_scales[i], "update_scales");
    const auto [src, prev] = versions_of(i, params, sources, previous);
    work[i] = ApplyTensor{params[i].ptr<float>(), src, prev, updates[i].data,
                          ef.empty() ? nullptr : ef[i].ptr<float>(), params[i].numel(), float(update_scales[i]),
                          float(-(lr * weight_decay)), float(ef_beta), modes[i]};
  }
  const int32_t* skip = skip_flag(skip_c, params[0]);
  const bool cuda = params[0].device == DeviceKind::cuda;
  py::gil_scoped_release release;
  if (!cuda) return skipped_on_cpu(skip) ? void() : apply_update_cpu(work, storage);
#ifdef ASYNCPP_WITH_CUDA
  apply_update_cuda(work, storage, skip, stream);
#else
  (void)stream;
  no_cuda_kernels("params");
#endif
}

int64_t first_nonfinite(const py::sequence& tensors_c, intptr_t stream) {
  const auto tensors = borrow_tensors(tensors_c, "tensors");
  if (tensors.empty()) return -1;
  std::vector<ConstTensor> work(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    expect_like(tensors[i], tensors[0], DType::f32, item("tensors", i));
    work[i] = ConstTensor{tensors[i].ptr<float>(), tensors[i].numel()};
  }
  const bool cuda = tensors[0].device == DeviceKind::cuda;
  py::gil_scoped_release release;
  if (!cuda) return first_nonfinite_cpu(work);
#ifdef ASYNCPP_WITH_CUDA
  return first_nonfinite_cuda(work, stream);
#else
  (void)stream;
  no_cuda_kernels("tensors");
#endif
}

void nonfinite_flag(const py::sequence& tensors_c, const py::handle& flag_c, intptr_t stream) {
  const auto tensors = borrow_tensors(tensors_c, "tensors");
  const TensorView flag = borrow_tensor(flag_c, "flag");
  expect_dtype(flag, DType::i32, "flag");
  expect_contiguous(flag, "flag");
  ASYNCPP_ARG_CHECK(flag.numel() == 1, "flag: expected one int32 element, got ", flag.numel());
  std::vector<ConstTensor> work(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    expect_like(tensors[i], tensors[0], DType::f32, item("tensors", i));
    work[i] = ConstTensor{tensors[i].ptr<float>(), tensors[i].numel()};
  }
  if (!tensors.empty()) {
    const auto where = [](const TensorView& t) {
      return t.device == DeviceKind::cpu ? std::string("the CPU") : "CUDA device " + std::to_string(t.device_index);
    };
    ASYNCPP_ARG_CHECK(flag.device == tensors[0].device && flag.device_index == tensors[0].device_index,
                      "flag: on ", where(flag), " but tensors[0] is on ", where(tensors[0]),
                      "; put the flag on the tensors' device");
  }
  int32_t* out = flag.ptr<int32_t>();
  const bool cuda = flag.device == DeviceKind::cuda;
  py::gil_scoped_release release;
  if (!cuda) {
    *out = int32_t(first_nonfinite_cpu(work));
    return;
  }
#ifdef ASYNCPP_WITH_CUDA
  nonfinite_flag_cuda(work, out, stream);
#else
  (void)stream;
  no_cuda_kernels("flag");
#endif
}

void accumulate(const py::sequence& dsts_c, const py::sequence& srcs_c, intptr_t stream) {
  const auto dsts = borrow_tensors(dsts_c, "dsts");
  const auto srcs = borrow_tensors(srcs_c, "srcs");
  const size_t n = dsts.size();
  expect_len(srcs.size(), n, "srcs", "dsts");
  if (n == 0) return;
  const Storage storage = storage_of(srcs[0], "srcs[0]");
  std::vector<AccumulateTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    expect_like(dsts[i], dsts[0], DType::f32, item("dsts", i));
    expect_like(srcs[i], dsts[0], srcs[0].dtype, item("srcs", i));
    expect_same_shape(dsts[i], srcs[i], item("dsts", i), item("srcs", i));
    work[i] = AccumulateTensor{dsts[i].ptr<float>(), srcs[i].data, dsts[i].numel()};
  }
  const bool cuda = dsts[0].device == DeviceKind::cuda;
  py::gil_scoped_release release;
  if (!cuda) return accumulate_cpu(work, storage);
#ifdef ASYNCPP_WITH_CUDA
  accumulate_cuda(work, storage, stream);
#else
  (void)stream;
  no_cuda_kernels("dsts");
#endif
}

void expect_matrix(const TensorView& t, DType dtype, const TensorView& first, const char* name) {
  expect_like(t, first, dtype, name);
  ASYNCPP_ARG_CHECK(t.shape.ndim == 2, name, ": expected a matrix (2 dimensions), got ", t.shape.ndim,
                    "; flatten the leading dimensions first");
}

// main_grad (out x in) += grad_output^T @ inputs, by cuBLAS (kernels/cublas_wgrad.h).
void add_weight_gradient(py::handle main_grad_c, py::handle grad_output_c, py::handle inputs_c,
                         intptr_t handle, intptr_t stream) {
  const TensorView g = borrow_tensor(main_grad_c, "main_grad");
  const TensorView dy = borrow_tensor(grad_output_c, "grad_output");
  const TensorView x = borrow_tensor(inputs_c, "inputs");
  ASYNCPP_ARG_CHECK(g.device == DeviceKind::cuda, "main_grad: a CUDA tensor is needed (cuBLAS adds the "
                    "product); on the CPU torch computes it (asyncpp_ext.pipeline.main_grad)");
  expect_matrix(g, DType::f32, g, "main_grad");
  expect_matrix(dy, DType::bf16, g, "grad_output");
  expect_matrix(x, DType::bf16, g, "inputs");
  ASYNCPP_ARG_CHECK(dy.shape.dims[1] == g.shape.dims[0], "grad_output: ", dy.shape.dims[1],
                    " columns, but main_grad has ", g.shape.dims[0], " rows (one per output feature)");
  ASYNCPP_ARG_CHECK(x.shape.dims[1] == g.shape.dims[1], "inputs: ", x.shape.dims[1],
                    " columns, but main_grad has ", g.shape.dims[1], " (one per input feature)");
  ASYNCPP_ARG_CHECK(x.shape.dims[0] == dy.shape.dims[0], "inputs: ", x.shape.dims[0],
                    " rows, but grad_output has ", dy.shape.dims[0], " (one per token)");
  ASYNCPP_ARG_CHECK(handle != 0, "handle: expected torch.cuda.current_blas_handle(), got 0");
  kernels::blas::WeightGradient w;
  w.handle = reinterpret_cast<void*>(handle);
  w.stream = reinterpret_cast<void*>(stream);
  w.main_grad = g.ptr<float>();
  w.grad_output = dy.data;
  w.inputs = x.data;
  w.rows = x.shape.dims[0];
  w.out = g.shape.dims[0];
  w.in = g.shape.dims[1];
  py::gil_scoped_release release;
  kernels::blas::add_weight_gradient(w);
}

}  // namespace

void bind_optim(py::module_& m) {
  auto o = m.def_submodule("optim", "Fused multi-tensor optimizer kernels (float32 state; DLPack capsules in).");
  o.def("adamw_step", &adamw_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("ef_bufs"), py::arg("steps"), py::arg("ef_first"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("ef_beta"),
        py::arg("stream") = 0, py::arg("sources") = py::list(), py::arg("previous") = py::list(),
        py::arg("skip") = py::none(),
        "One AdamW step (torch.optim.AdamW arithmetic) over all tensors; steps[i] is tensor i's step count "
        "after this update. ef_bufs=[] and previous=[] turn error feedback off. sources[i] holds W(t) "
        "and params[i] receives W(t+1) (sources=[]: in place); previous[i] holds W(t-1) for error "
        "feedback from the weights (None: no correction for that tensor). params[i] may be the very "
        "storage of sources[i] or previous[i]. skip: a nonfinite_flag result; >= 0 changes nothing.");
  o.def("muon_momentum", &muon_momentum, py::arg("grads"), py::arg("momentum_bufs"), py::arg("outs"),
        py::arg("momentum"), py::arg("nesterov"), py::arg("sumsq") = py::none(), py::arg("stream") = 0,
        py::arg("skip") = py::none(),
        "B <- mu*B + (1-mu)*G; outs <- nesterov ? (1-mu)*G + mu*B : B (float32 or bfloat16); "
        "sumsq[i] <- sum(outs[i]^2) when given. skip: as in adamw_step (outs and sumsq then unspecified).");
  o.def("apply_update", &apply_update, py::arg("params"), py::arg("updates"), py::arg("ef_bufs"),
        py::arg("update_scales"), py::arg("ef_first"), py::arg("lr"), py::arg("weight_decay"),
        py::arg("ef_beta"), py::arg("stream") = 0, py::arg("sources") = py::list(),
        py::arg("previous") = py::list(), py::arg("skip") = py::none(),
        "W(t+1) = W(t) + D, D = -lr*wd*W(t) + update_scales[i]*updates[i], with error feedback when ef_bufs "
        "(E from the buffer) or previous (E = W(t) - W(t-1)) is not empty. W(t) is read from sources[i] "
        "(sources=[]: in place) and W(t+1) written to params[i], as in adamw_step; skip as there.");
  o.def("first_nonfinite", &first_nonfinite, py::arg("tensors"), py::arg("stream") = 0,
        "Index of the first float32 tensor holding a NaN or Inf, or -1.");
  o.def("nonfinite_flag", &nonfinite_flag, py::arg("tensors"), py::arg("flag"), py::arg("stream") = 0,
        "flag (one int32 element on the tensors' device) <- the index of the first float32 tensor holding "
        "a NaN or Inf, or -1; on CUDA queued on the stream, the host not waiting (the fused steps' skip).");
  o.def("add_weight_gradient", &add_weight_gradient, py::arg("main_grad"), py::arg("grad_output"),
        py::arg("inputs"), py::arg("handle"), py::arg("stream"),
        "main_grad (out x in, float32, CUDA) += grad_output^T (T x out, bfloat16) @ inputs (T x in, "
        "bfloat16), summed in float32 by cuBLAS's GEMM (beta = 1) on torch's handle, which must be on "
        "stream (torch.cuda.current_blas_handle()).");
  o.def("cublas_library", &kernels::blas::cublas_library,
        "The cuBLAS library add_weight_gradient calls (torch's, among the loaded ones), or why none is found.");
  o.def("set_cublas_soname", &kernels::blas::set_cublas_soname, py::arg("soname"),
        "Take only this cuBLAS soname (the one torch's CUDA version links, e.g. libcublas.so.12); \"\" = the "
        "newest loaded one.");
  o.def("accumulate", &accumulate, py::arg("dsts"), py::arg("srcs"), py::arg("stream") = 0,
        "dsts[i] += srcs[i] over every tensor in one call: float32 dsts, srcs all float32 or all bfloat16 "
        "(widened exactly), each shaped like its dst.");
}

}  // namespace asyncpp::bindings
