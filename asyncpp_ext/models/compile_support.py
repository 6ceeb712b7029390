"""Can torch compile blocks here, and should it: the checks behind ``--compile`` (docs/design.md
§2.11), apart from the compiling itself (models/compile.py).

    compile_unavailable_reason(device, *, probe=False) -> str | None
    resolve_compile(flag, device) -> bool
    MODES, inductor_mode(name) -> str | None   ``--compile-mode`` and the mode it gives torch
    parse_inductor_option("NAME=VALUE"), check_inductor_options(dict)   ``--inductor-option``
    DEVICE_OPTIONS, device_inductor_options(device, options) -> dict   the defaults per device
    CompileUnavailableError   (a ValueError whose message is one line)
    _describe(exc) -> str     ``Type: first line`` of an exception, through dynamo's wrappers
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import warnings
from typing import Any

import torch


class CompileUnavailableError(ValueError):
    """Compilation was requested where torch cannot compile; the message is one line."""


MODES = ("default", "max-autotune")
"""``--compile-mode`` values: inductor's modes but those that capture CUDA graphs (reduce-overhead;
max-autotune's graphs are switched off where it compiles, models/compile.py)."""


def inductor_mode(name: str) -> str | None:
    """The ``mode`` torch.compile gets for ``--compile-mode name`` (None: torch's default)."""
    if name not in MODES:
        raise ValueError(f"compile mode {name!r} is not one of {', '.join(MODES)}")
    return None if name == "default" else name


DEVICE_OPTIONS = {
    # Every concatenation lowered as kernels that each compute one input straight into its slice,
    # not one kernel of masked loads that works out every input's indices for every element: the
    # rotary backward's q/k/v gradient took 85 us per smollm-360m block that way, and the whole
    # step ran 1.04x faster without it on an H100 (docs/gpu.md). On a torch whose inductor lacks
    # the second option, models/concat_lowering.py gives the first its meaning.
    "cuda": {"max_pointwise_cat_inputs": 0, "max_complex_pointwise_cat_inputs": 0},
}
"""Inductor options compiled blocks get by default per device type, as one set: options that
name any of a set's names replace the whole set (those names alone then come from the caller and
inductor's own defaults)."""


def device_inductor_options(device, options=None, known=None) -> dict:
    """``options`` on top of ``DEVICE_OPTIONS`` for ``device``'s type, keeping of the defaults only
    the names this torch's inductor has (``known``: its option names), and none of them where
    ``options`` names one."""
    defaults = DEVICE_OPTIONS.get(_device(device).type, {})
    options = dict(options or {})
    if not defaults or set(defaults) & set(options):
        return options
    if known is None:
        from torch._inductor import config

        known = config.get_config_copy()
    return {**{k: v for k, v in defaults.items() if k in known}, **options}


FORCED_OPTIONS = ("freezing", "triton.cudagraphs")
"""Inductor options compiled blocks always set off (models/compile.py): both would capture
parameter values or addresses, which the 2bw weight swap changes."""


def parse_inductor_option(text: str) -> tuple[str, Any]:
    """``"NAME=VALUE"`` (``--inductor-option``) -> (NAME, VALUE): VALUE read as a Python literal
    (0, 1.5, True, None, 'text'; true/false in any case too), else kept as the string given.
    ``"none"`` -> ("", None): no options (clears those a resumed run saved)."""
    if str(text).strip().lower() == "none":
        return "", None
    name, sep, raw = str(text).partition("=")
    if not sep or not name.strip():
        raise ValueError(f"expected NAME=VALUE (e.g. max_pointwise_cat_inputs=0) or none, got {text!r}")
    raw = raw.strip()
    if raw.lower() in ("true", "false"):
        return name.strip(), raw.lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return name.strip(), value


def _fits(value, default) -> bool:
    """Whether ``value`` can stand where inductor's default is ``default`` (a bool for a bool, a
    whole number for an int, a number for a float, a string for a string; anything plain where
    the default is None)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    return default is None


def check_inductor_options(options, where: str = "train.inductor_options") -> dict:
    """``options`` as a dict of inductor config names this torch has and plain values (a bool,
    number, string or None), or ValueError (one line) naming the first that is not."""
    if not isinstance(options, dict):
        raise ValueError(f"{where} must be an object of inductor option names and values, got {options!r}")
    if not options:
        return {}
    from torch._inductor import config

    defaults = config.get_config_copy()  # every option's name (dotted for nested ones) and default
    for name, value in options.items():
        if name in FORCED_OPTIONS:
            raise ValueError(f"{where}: {name} stays off for compiled blocks (it would capture weight values "
                             "or addresses, which the 2bw weight swap changes); drop it")
        if not isinstance(name, str) or name not in defaults:
            raise ValueError(f"{where}: {name!r} is not an option of this torch's inductor "
                             f"(torch {torch.__version__}; see torch/_inductor/config.py)")
        plain = isinstance(value, (bool, int, float, str))
        if value is not None and not (plain and _fits(value, defaults[name])):
            raise ValueError(f"{where}: {name} takes a value like its default {defaults[name]!r}, got {value!r}")
    return dict(options)


# ---------------------------------------------------------------------------------------------
# Can torch compile here?


def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def _first_line(text: str, limit: int = 240) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def compile_unavailable_reason(device, *, probe: bool = False) -> str | None:
    """Why ``torch.compile`` (inductor) cannot compile blocks for ``device`` here, as one line, or
    None where it can.

    Checks, cheapest first: the Python/torch combination (dynamo's own check), that this torch lifts
    module parameters into graphs (``inline_inbuilt_nn_modules``, which the shared graphs and the
    weight swap rely on), then per device: CPU needs a C++ compiler inductor finds (``CXX`` or
    ``g++``) that runs; CUDA needs a visible GPU, the triton package and compute capability >= 7.0.
    Other device types are not supported by this module. With ``probe`` a one-op function is also
    compiled and run on ``device`` (seconds on a cold cache), which catches a compiler that is
    present but broken (missing headers, ...)."""
    try:
        dev = _device(device)
    except (RuntimeError, TypeError) as exc:
        return f"{device!r} is not a torch device ({_first_line(exc)})"
    try:
        from torch._dynamo.eval_frame import check_if_dynamo_supported
        check_if_dynamo_supported()
    except ImportError:
        return f"torch {torch.__version__} has no torch._dynamo"
    except Exception as exc:  # it raises RuntimeError with the reason
        return f"torch.compile is not supported here: {_first_line(exc)}"
    import torch._dynamo.config as dynamo_config
    with warnings.catch_warnings():  # torch 2.13 deprecates the flag (always on) with a FutureWarning
        warnings.simplefilter("ignore")
        inlined = getattr(dynamo_config, "inline_inbuilt_nn_modules", True)
    if not inlined:
        return (f"torch {torch.__version__} compiles modules with their parameters as constants "
                "(torch._dynamo.config.inline_inbuilt_nn_modules is off); turn it on or upgrade torch")
    if dev.type == "cpu":
        reason = _cpu_compiler_reason()
    elif dev.type == "cuda":
        reason = _cuda_reason(dev)
    else:
        return f"compiled blocks are supported on cpu and cuda, not {dev.type}"
    if reason is None and probe:
        reason = _probe(dev)
    return reason


def _cpu_compiler_reason() -> str | None:
    """Inductor's CPU code is C++ built at run time by the first of ``config.cpp.cxx`` that runs."""
    try:
        from torch._inductor import config as inductor_config
    except Exception as exc:  # an incomplete install
        return f"torch's inductor does not import ({_first_line(exc)})"
    candidates = inductor_config.cpp.cxx
    candidates = [c for c in (candidates if isinstance(candidates, (list, tuple)) else (candidates,)) if c]
    for cxx in candidates:
        if shutil.which(cxx) is None:
            continue
        try:  # what inductor itself runs to accept a compiler (cpp_builder.cpp_compiler_search)
            subprocess.run([cxx, "--version"], check=True, capture_output=True, timeout=30)
            return None
        except (OSError, subprocess.SubprocessError):
            continue
    names = ", ".join(candidates) or "none configured"
    return (f"no working C++ compiler for inductor's CPU code (tried: {names}); install g++ "
            "or set CXX to a C++ compiler")


def _cuda_reason(dev: torch.device) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available to torch here (no GPU visible or a CPU build of torch)"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return f"{dev} does not exist: torch sees {torch.cuda.device_count()} GPU(s)"
    try:
        from torch.utils._triton import has_triton_package
    except ImportError:
        has_triton_package = None
    if has_triton_package is not None and not has_triton_package():
        return "the triton package is not installed (inductor generates Triton kernels for CUDA); pip install triton"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 7:
        return (f"{torch.cuda.get_device_name(index)} has compute capability {major}.{minor}; "
                "inductor's Triton kernels need 7.0 or newer")
    return None


def _probe(dev: torch.device) -> str | None:
    """Compile and run ``x * 2 + 1`` on ``dev`` with inductor; the failure's first line, or None."""
    def twice_plus_one(x):
        return x * 2 + 1
    try:
        fn = torch.compile(twice_plus_one, backend="inductor", dynamic=False)
        x = torch.arange(8, dtype=torch.float32, device=dev)
        if not torch.equal(fn(x), x * 2 + 1):
            return "a compiled probe function returned wrong values"
    except Exception as exc:
        return f"a compiled probe function failed: {_describe(exc)}"
    return None


def resolve_compile(flag: bool | None, device) -> bool:
    """Whether blocks on ``device`` are compiled, from ``--compile`` (True), ``--no-compile`` (False)
    or auto (None).

    Auto compiles on CUDA where torch can, and stays eager on CPU: there the first compiled step
    costs 28-50 s on 2 cores with a cold inductor cache (3-13 s warm) and a llama-tiny step gains
    3-7 % (docs/design.md §2.11). Auto never raises; True where ``compile_unavailable_reason``
    has a reason raises CompileUnavailableError naming it (the CLI turns it into one line, exit 2)."""
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"compile must be True, False or None (auto), got {flag!r}")
    if flag is False:
        return False
    reason = compile_unavailable_reason(device)
    if flag is None:
        return reason is None and _device(device).type == "cuda"
    if reason is not None:
        raise CompileUnavailableError(f"compiling was requested but torch cannot compile for {device} "
                                      f"here: {reason}")
    return True


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of an exception, following dynamo's wrappers to the root cause
    (BackendCompilerFailed's first line is only ``backend='...' raised:``)."""
    names, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        names.append(type(exc).__name__)
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    message = _first_line(exc)
    if message.startswith("backend=") and message.endswith("raised:"):
        message = ""
    chain = ": ".join(dict.fromkeys(names))
    return f"{chain}: {message}" if message else chain


__all__ = ["MODES", "FORCED_OPTIONS", "CompileUnavailableError", "compile_unavailable_reason", "inductor_mode",
           "parse_inductor_option", "check_inductor_options", "resolve_compile", "DEVICE_OPTIONS",
           "device_inductor_options"]
