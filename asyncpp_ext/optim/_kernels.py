"""Thin calls into the fused kernels (asyncpp_ext._C.optim): tensors go in as DLPack capsules.

On CUDA every call runs with the tensors' device current (the kernels launch on the current
device) on that device's current torch stream. An argument a kernel refuses raises its ValueError
without the ' [file.cpp:12: cond]' the C++ check appends for debugging (``_Kernels``)."""
from __future__ import annotations

import contextlib
import functools
import re

import torch
from torch.utils.dlpack import to_dlpack

from .._ext import C, without_source_location


class _Kernels:
    """``C.optim``'s functions, each raising its ValueError as one line for the user: every kernel
    call goes through here, so no call site needs a handler of its own."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        kernel = getattr(self._module, name)

        @functools.wraps(kernel)
        def call(*args):
            try:
                return kernel(*args)
            except ValueError as exc:
                raise ValueError(without_source_location(exc)) from None

        setattr(self, name, call)  # looked up once: later calls find the attribute
        return call


_K = _Kernels(C.optim)
_cuda_usable = None
_arch_checked: set = set()  # device indices whose architecture this build covers


def capsules(tensors):
    return [to_dlpack(t) for t in tensors]


def optional_capsules(tensors):
    """Like capsules, with None entries kept as None (the kernels read None as "not given")."""
    return [None if t is None else to_dlpack(t) for t in tensors]


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device as an integer (0 for CPU tensors)."""
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


_ARCH_RE = re.compile(r"(\d+)(\d)([af]?)(?:-(real|virtual))?")


def parse_cuda_archs(archs: str) -> list[tuple[int, int, str, bool, bool]] | None:
    """CMake's CUDA_ARCHITECTURES as built ("80-real;86-real;90") -> [(major, minor, suffix, sass,
    ptx)]: "-real" is SASS only, "-virtual" PTX only, plain both. None when an entry is not of that
    form ("all", "native"): then nothing can be said about coverage."""
    out = []
    for item in filter(None, (a.strip() for a in archs.split(";"))):
        m = _ARCH_RE.fullmatch(item)
        if not m:
            return None
        major, minor, suffix, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        out.append((major, minor, suffix, kind != "virtual", kind != "real"))
    return out


def cuda_arch_coverage(capability: tuple[int, int], archs: str) -> str | None:
    """How a build for ``archs`` runs on a GPU of compute capability ``capability``: "SASS sm_XY"
    (binary compatible: same major, minor <= the GPU's), "PTX compute_XY (JIT)" (any capability
    <= the GPU's), "unknown" for archs that cannot be parsed, or None when nothing in the build can
    run there. Arch-specific entries (90a) run only on exactly that capability."""
    parsed = parse_cuda_archs(archs)
    if parsed is None:
        return "unknown"
    major, minor = capability
    fits = lambda a_major, a_minor, suffix, same_major: (  # noqa: E731
        (a_major, a_minor) == (major, minor) if suffix == "a" else
        (a_major == major and a_minor <= minor) if same_major else (a_major, a_minor) <= (major, minor))
    sass = [(a, b, s) for a, b, s, has_sass, _ in parsed if has_sass and fits(a, b, s, True)]
    if sass:
        a, b, s = max(sass)
        return f"SASS sm_{a}{b}{s}"
    ptx = [(a, b, s) for a, b, s, _, has_ptx in parsed if has_ptx and fits(a, b, s, False)]
    if ptx:
        a, b, s = max(ptx)
        return f"PTX compute_{a}{b}{s} (JIT)"
    return None


def cuda_arch_error(device: str, name: str, capability: tuple[int, int], archs: str) -> str:
    """The message for a GPU this build has no code for."""
    cc = f"{capability[0]}.{capability[1]}"
    return (f"asyncpp_ext's CUDA kernels cannot run on {device} ({name}, compute capability {cc}): this build "
            f"has code for CUDA archs {archs or 'none'} (SASS runs on the same major version at an equal or "
            f"higher minor, PTX on equal or higher capabilities), none of which runs there. Rebuild with "
            f"TORCH_CUDA_ARCH_LIST=\"{cc}\" set, e.g. TORCH_CUDA_ARCH_LIST=\"{cc}\" python -m pip install "
            f"--no-build-isolation --no-deps -e .")


def _check_cuda_kernels(device: torch.device | None = None) -> None:
    """Fail with the reason (and the fix) when our CUDA kernels cannot run although torch can:
    no device for our CUDA runtime, or (checked once per device) no code for its architecture."""
    global _cuda_usable
    if _cuda_usable is None:
        _cuda_usable = C.cuda_device_count() > 0
    built = C.build_config()
    if not _cuda_usable:
        raise RuntimeError(
            "asyncpp_ext's CUDA kernels cannot run here: " + (C.cuda_status() or "no CUDA device") +
            f". They were built with nvcc {built['nvcc_version'] or '(none)'} (archs "
            f"{built['cuda_archs'] or 'none'}) while torch uses CUDA {torch.version.cuda}; rebuild "
            "asyncpp_ext with a CUDA toolkit the installed driver supports (pip install . with that nvcc "
            "on PATH), or keep the optimizer on CPU")
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _arch_checked:
        capability = tuple(torch.cuda.get_device_capability(index))
        if cuda_arch_coverage(capability, built["cuda_archs"]) is None:
            raise RuntimeError(cuda_arch_error(f"cuda:{index}", torch.cuda.get_device_name(index), capability,
                                               built["cuda_archs"]))
        _arch_checked.add(index)


def kernels_usable(t: torch.Tensor) -> bool:
    """Whether our kernels can run on ``t``'s device (always on CPU; on CUDA when this build has
    kernels that run there), for callers that have a torch path to fall back on."""
    if t.device.type == "cpu":
        return True
    if t.device.type != "cuda":
        return False
    try:
        _check_cuda_kernels(t.device)
    except RuntimeError:
        return False
    return True


def cpu_kernel_isa() -> str:
    """The ISA the CPU kernels run with in this process ("baseline", "avx2", "avx512f"), chosen once
    from $ASYNCPP_CPU_ISA and the CPU; ValueError naming the variable when the setting cannot be
    honoured here."""
    return C.cpu_kernel_isa_check()


def on_device_of(t: torch.Tensor):
    """Make t's CUDA device current for a kernel call (nothing for CPU tensors)."""
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    _check_cuda_kernels(t.device)
    return torch.cuda.device(t.device)


def _optional(t):
    return None if t is None else to_dlpack(t)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, ef_bufs, steps, ef_first, *, lr, beta1, beta2,
               eps, weight_decay, ef_beta, sources=(), previous=(), skip=None):
    """sources: W(t) per parameter, () = in place; params receive W(t+1). previous: W(t-1) per
    parameter for error feedback from the weights (with ef_bufs=[]; None = no correction). skip: a
    ``nonfinite_flag`` result on the same device; where it holds an index (>= 0) nothing changes."""
    if not params:
        return
    with on_device_of(params[0]):
        _K.adamw_step(capsules(params), capsules(grads), capsules(exp_avgs), capsules(exp_avg_sqs),
                      capsules(ef_bufs), steps, ef_first, lr, beta1, beta2, eps, weight_decay, ef_beta,
                      stream_of(params[0]), capsules(sources), optional_capsules(previous), _optional(skip))


def muon_momentum(grads, bufs, outs, *, momentum, nesterov, sumsq=None, skip=None):
    """skip as in adamw_step (outs and sumsq are then left unspecified)."""
    if not grads:
        return
    with on_device_of(grads[0]):
        _K.muon_momentum(capsules(grads), capsules(bufs), capsules(outs), momentum, nesterov,
                         _optional(sumsq), stream_of(grads[0]), _optional(skip))


def apply_update(params, updates, ef_bufs, update_scales, ef_first, *, lr, weight_decay, ef_beta,
                 sources=(), previous=(), skip=None):
    """sources, previous and skip as in adamw_step."""
    if not params:
        return
    with on_device_of(params[0]):
        _K.apply_update(capsules(params), capsules(updates), capsules(ef_bufs), update_scales, ef_first,
                        lr, weight_decay, ef_beta, stream_of(params[0]), capsules(sources),
                        optional_capsules(previous), _optional(skip))


def accumulate(dsts, srcs) -> None:
    """dsts[i] += srcs[i] for every i in one kernel launch: float32 dsts, srcs all float32 or all
    bfloat16 (widened exactly; the sum torch's mixed ``add_`` gives), contiguous, on one device."""
    if not dsts:
        return
    with on_device_of(dsts[0]):
        _K.accumulate(capsules(dsts), capsules(srcs), stream_of(dsts[0]))


def nonfinite_flag(tensors, flag: torch.Tensor) -> None:
    """flag (one int32 element on the tensors' device) <- the index of the first tensor holding NaN/
    Inf, or -1: the scan ``first_nonfinite`` does, left on the device for a fused step's ``skip``
    (on CUDA queued on the current stream; the host does not wait)."""
    with on_device_of(flag):
        _K.nonfinite_flag(capsules(tensors), to_dlpack(flag), stream_of(flag))


def first_nonfinite(tensors) -> int:
    """Index of the first tensor holding NaN/Inf, or -1 (one read pass; syncs on CUDA)."""
    if not tensors:
        return -1
    if not tensors[0].is_cuda:  # no device or stream to set: the pipeline checks small tensors per microbatch
        return _K.first_nonfinite(capsules(tensors), 0)
    with on_device_of(tensors[0]):
        return _K.first_nonfinite(capsules(tensors), stream_of(tensors[0]))


def torch_cublas_soname() -> str:
    """The cuBLAS soname torch's CUDA version links (libcublas.so.<major>), "" for a CPU build."""
    return f"libcublas.so.{torch.version.cuda.split('.')[0]}" if torch.version.cuda else ""


_K.set_cublas_soname(torch_cublas_soname())  # torch's own cuBLAS, never another loaded major version


def add_weight_gradient(main_grad, grad_output, inputs) -> None:
    """main_grad (out x in, float32) += grad_output^T (T x out) @ inputs (T x in), bf16 operands summed
    in float32 by cuBLAS on the current stream (CUDA only: pipeline/main_grad.py computes it with
    torch elsewhere)."""
    with torch.cuda.device(main_grad.device):  # (cuBLAS's product: none of this build's kernels)
        _K.add_weight_gradient(to_dlpack(main_grad), to_dlpack(grad_output), to_dlpack(inputs),
                               torch.cuda.current_blas_handle(), stream_of(main_grad))


def cublas_library() -> str:
    """The cuBLAS library ``add_weight_gradient`` calls (torch's, once loaded), or why none is found."""
    return _K.cublas_library()
