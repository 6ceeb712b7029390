"""Regional compilation of pipeline blocks: each block compiled in place with ``torch.compile``,
identical blocks sharing one compiled graph (docs/design.md §2.11).

API (what the Pipeline, the simulator and the CLI call)::

    compile_unavailable_reason(device, *, probe=False) -> str | None
        Why torch cannot compile blocks for ``device`` here (one line), or None where it can.
    resolve_compile(flag: bool | None, device) -> bool
        ``--compile`` (True), ``--no-compile`` (False) or auto (None) -> whether to compile.
        (Both live in compile_support.py and are re-exported here.)
    compile_blocks(blocks, *, device=None, backend="inductor", mode=None, options=None,
                   fullgraph=True, dynamic=False) -> CompileReport
        Compile every block of ``blocks`` (an nn.Sequential, a list of modules, or a model with
        ``blocks()``) in place. Compilation is lazy: it happens at a block's first call.
    uncompile(blocks) -> None          back to plain eager modules
    is_compiled(module) -> bool
    CompileReport                      .compiles / .fallbacks per block type, .summary()

A compile failure is not an exception: it is ONE ``logging.WARNING`` line on the logger
``asyncpp_ext.models.compile`` per cause and process (see "Fallback" below). Without logging
configured, Python prints such a record as the bare message on stderr (``logging.lastResort``).

Typical use by a pipeline stage::

    # CompileUnavailableError (one line) for --compile where torch cannot compile
    if resolve_compile(cfg.compile, device):
        report = compile_blocks(stage_module, device=device)
    ...  # after the first steps: log report.summary()

``compile_blocks`` may run before or after StageHost makes its replicas (deep copies stay
compiled); the first call should come after the weights are flattened into their buffers, since on
CUDA inductor takes the parameters' alignment from the call that compiles (StageHost flattens in
its constructor, before any forward).

What "in place" means. Each block gets an instance attribute ``forward`` (a ``_CompiledForward``)
that runs ``type(block).forward`` through one compiled function shared by every block of that
type (and the same compile settings). Nothing else changes: parameter names, ``named_parameters()``
order and ``state_dict()`` keys are those of the eager block (checkpoints and the optimizer key on
them), hooks still run (outside the compiled region), ``block.to(...)`` works.
``nn.Module.compile()`` is not used because ``nn.Module.__getstate__`` drops its
``_compiled_call_impl``: the replicas the 2bw stage makes with ``copy.deepcopy`` (one per weight
version, pipeline/stage.py) would silently run eagerly. Our ``forward`` attribute survives
``deepcopy`` and pickling and re-binds to the copy (``__reduce__``), so a replica compiles nothing
new: it shares the original's compiled code.

Why one graph serves N blocks and every replica. Dynamo (torch >= 2.5,
``inline_inbuilt_nn_modules``) traces a module passed as an argument without specialising on its
identity: parameters become graph inputs, read from the module at every call, and the guards check
their dtype, device, shape, stride and requires_grad, not their address. So block 3, block 7 and
block 3 of a deep-copied replica pass the same guards and run the same code. The compiled
function of each block type has a code object of its own, so each type gets its own dynamo cache
(and its own ``recompile_limit`` of 8 variants) instead of all types competing for one.

Why the 2bw weight swap is safe. The stage re-points ``p.data`` at a view into another flat
buffer between versions. The Parameter object stays; the compiled code loads it from the module
on each call and passes its current storage to the kernels, so the live buffer is read. Two
inductor features would capture weights and are switched off here: freezing (constant-folds
parameters in no_grad graphs; ``TORCHINDUCTOR_FREEZING=1`` would turn it on globally) and CUDA
graphs (``mode="reduce-overhead"``, refused; ``max-autotune``'s cudagraphs are switched off):
they would replay the address a parameter had when captured.

Recompilation. ``dynamic=False``: shapes are specialised; a run has a fixed (B, T) per microbatch,
so training compiles once per block type (forward and, in the same call, backward). A forward under
``torch.no_grad`` (the pipeline's start-up probe, evaluation) is another graph, and an evaluation
batch of another size one more: at most 3 graphs per block type in a run, counted in
``CompileReport.compiles``. Layers of one type that differ in a Python attribute their forward
reads (an HF qwen2/qwen3 model mixing sliding-window and full-attention layers) get one graph per
distinct value. Past torch's ``recompile_limit`` (8 variants of one type) dynamo runs the further
variants eagerly, with its own warning.

The same compiled code serves every model built from the same block type in a process (the HF
adapter's layer type serves llama, mistral and qwen models alike; guards tell them apart).

Fallback. A failure of dynamo, inductor or the C++/Triton toolchain shows at a block's first call
(compilation is lazy). The call is then run eagerly: if eager fails too, the error is the model's
own and is raised as eager raises it (never hidden by the fallback); if eager succeeds, the block
type is marked failed and runs eagerly from then on (every block and replica of that type), and ONE
warning line names the type and the cause (once per cause: when the embedding, the layers and the
head fail alike, as with a missing compiler, one line says so; ``CompileReport.fallbacks`` lists
every type). Backward graphs are compiled together with the forward
(``torch._functorch.config.force_non_lazy_backward_lowering``, normally lazy at the first
backward), so a backward compile failure also surfaces inside the forward call we guard.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import types
from typing import Any, Callable, Iterable

import torch
import torch._functorch.config  # noqa: F401 -- force_non_lazy_backward_lowering, patched per compile
from torch import nn

from . import concat_lowering
from .attention import sdpa_state
from .base import REGION_MARK
from .compile_support import (MODES, CompileUnavailableError, _describe, _device,  # noqa: F401 -- re-exported
                              compile_unavailable_reason, device_inductor_options, inductor_mode,
                              resolve_compile)

log = logging.getLogger(__name__)

_CUDAGRAPH_MODES = ("reduce-overhead",)


# ---------------------------------------------------------------------------------------------
# Compiled forward, shared per block type


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The compile arguments; blocks of one type with equal settings share one compiled function."""
    backend: Any
    mode: str | None
    options: tuple
    fullgraph: bool
    dynamic: bool | None
    sdpa: tuple = ()
    """torch's SDPA choice when the blocks were compiled (models/attention.sdpa_state): a traced
    graph keeps the attention kernel it was traced with, so another choice compiles anew."""


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _call_forward(module, *args, **kwargs):
    # The body every compiled function runs: the block's own forward, looked up on its class so
    # that our instance attribute ``forward`` does not call itself.
    return type(module).forward(module, *args, **kwargs)


class _Group:
    """One compiled function for every block of one type (or every region of one sequence of block
    types, models/regions.py) with one settings: its dynamo cache, the number of graphs it
    compiled, and whether it failed (then it runs eagerly)."""

    def __init__(self, key, settings: _Settings, *, name: str, code_name: str,
                 body: Callable = _call_forward):
        self.cls, self.settings = key, settings  # the block type, or the region's tuple of types
        self.name = name
        self.compiles = 0
        self.failure: str | None = None
        # A code object of its own (dynamo keys its cache on code objects): each block type gets
        # its own cache and recompile limit, and profiles / TORCH_LOGS name the type.
        code = body.__code__.replace(co_name=code_name, co_qualname=code_name) \
            if hasattr(body.__code__, "co_qualname") else body.__code__.replace(co_name=code_name)
        fn = types.FunctionType(code, body.__globals__, code_name)
        self.fn = torch.compile(fn, backend=self._backend(), fullgraph=settings.fullgraph,
                                dynamic=settings.dynamic)

    def call(self, eager: Callable, *args, **kwargs):
        """``self.fn(*args)``, or ``eager(*args)`` once compiling failed (the first failure is
        re-run eagerly and logged; a failure of eager too is the model's own error, raised)."""
        if self.failure is None:
            try:
                return self.fn(*args, **kwargs)
            except _OOM:
                raise  # memory, not compilation: eager would only fail later, or hide it
            except Exception as exc:  # noqa: BLE001 -- told apart from the model's own errors below
                failure = exc
            # Outside the except block, so the model's own error (eager fails too) is raised alone,
            # not chained to dynamo's report of the same error.
            out = eager(*args, **kwargs)
            self.fail(failure)
            return out
        return eager(*args, **kwargs)

    def _backend(self) -> Callable:
        settings = self.settings
        inner = settings.backend
        if inner == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx
            patches = dict(list_mode_options(settings.mode, settings.dynamic)) if settings.mode else {}
            patches.update(dict(settings.options))
            # max_pointwise_cat_inputs=0: the concatenations newer releases build with it (and
            # max_complex_pointwise_cat_inputs=0), on releases that cannot be asked for them too
            concat_lowering.install_if_needed(patches)
            # Both would capture parameter values or addresses (see the module docstring).
            patches.update({"freezing": False, "triton.cudagraphs": False})
            inner = functools.partial(compile_fx, config_patches=patches)
        elif isinstance(inner, str):
            inner = torch._dynamo.lookup_backend(inner)
        self.compiler = inner  # what the group hands its graphs to (inductor's, with our patches)

        # Compile the backward now, inside the forward call that the fallback guards, instead of
        # lazily at the first backward (where a failure would escape as a training error). Older
        # torch releases without the switch keep the lazy backward.
        eager_backward = _EAGER_BACKWARD

        def backend(gm, example_inputs):
            self.compiles += 1
            with torch._functorch.config.patch(**eager_backward):
                return inner(gm, example_inputs)
        return backend

    def fail(self, exc: BaseException) -> None:
        self.failure = _describe(exc)
        # One line per cause: a missing compiler fails every block type the same way, and three
        # identical lines (embedding, layer, head) would say nothing more. CompileReport.fallbacks
        # lists every type that fell back.
        if self.failure in _WARNED:
            log.debug("asyncpp: torch.compile failed for %s blocks too (%s)", self.name, self.failure)
            return
        _WARNED.add(self.failure)
        log.warning("asyncpp: torch.compile failed for %s blocks (%s); they, and any block that fails "
                    "the same way, run eagerly from now on", self.name, self.failure)


_GROUPS: dict[tuple, _Group] = {}
_WARNED: set[str] = set()  # causes already logged in this process
_EAGER_BACKWARD = ({"force_non_lazy_backward_lowering": True}
                   if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering") else {})


def _group(cls: type, settings: _Settings) -> _Group:
    key = (cls, settings)
    group = _GROUPS.get(key)
    if group is None:
        group = _GROUPS[key] = _Group(cls, settings, name=cls.__qualname__,
                                      code_name=f"compiled_{cls.__name__}")
    return group


def _rebind(module: nn.Module, cls: type, settings: _Settings) -> "_CompiledForward":
    return _CompiledForward(module, _group(cls, settings))


class _CompiledForward:
    """A block's ``forward`` instance attribute: the block run through its type's compiled function,
    or eagerly once that function failed to compile."""

    __slots__ = ("module", "group")

    def __init__(self, module: nn.Module, group: _Group):
        self.module, self.group = module, group

    def __call__(self, *args, **kwargs):
        return self.group.call(_call_forward, self.module, *args, **kwargs)

    def __reduce__(self):
        # deepcopy (the stage's weight-version replicas) and pickling re-bind to the copied module
        # and find the same group: the copy shares the compiled code and the failure state.
        return _rebind, (self.module, self.group.cls, self.group.settings)

    def __repr__(self) -> str:
        state = f"eager after failure: {self.group.failure}" if self.group.failure else "compiled"
        return f"<compiled forward of {self.group.name} ({state})>"


# ---------------------------------------------------------------------------------------------
# Public entry points


def _as_blocks(blocks) -> list[nn.Module]:
    if isinstance(blocks, nn.Sequential):
        out = list(blocks)
    elif hasattr(blocks, "blocks") and callable(blocks.blocks):
        out = list(blocks.blocks())
    elif isinstance(blocks, nn.Module):
        out = [blocks]
    elif isinstance(blocks, Iterable):
        out = list(blocks)
    else:
        raise TypeError(f"cannot compile a {type(blocks).__name__}: pass an nn.Sequential, a list of "
                        "nn.Module blocks, or a model with blocks()")
    bad = [i for i, b in enumerate(out) if not isinstance(b, nn.Module)]
    if bad:
        raise TypeError(f"block {bad[0]} is a {type(out[bad[0]]).__name__}, not an nn.Module")
    return out


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place by ``compile_blocks``."""
    return isinstance(module.__dict__.get("forward"), _CompiledForward)


@dataclasses.dataclass
class CompileReport:
    """What ``compile_blocks`` did. Compilation is lazy, so ``compiles`` and ``fallbacks`` are
    live: read them after the first steps. They are per block type and process: another model with
    the same block type (a second ``compile_blocks`` call, a deep copy) shares and adds to them."""

    device: str
    blocks: list[str]
    """The type of each compiled block, in order."""
    groups: list[_Group] = dataclasses.field(repr=False)

    @property
    def compiles(self) -> dict[str, int]:
        """Graphs compiled so far per block type (forward + backward count as one)."""
        return {g.name: g.compiles for g in self.groups}

    @property
    def options(self) -> dict:
        """The inductor options the blocks compile with (the caller's on top of the device's
        defaults; {} for another backend)."""
        return dict(self.groups[0].settings.options) if self.groups else {}

    @property
    def fallbacks(self) -> dict[str, str]:
        """Block types that failed to compile and run eagerly, with the cause."""
        return {g.name: g.failure for g in self.groups if g.failure is not None}

    def summary(self) -> str:
        """One line for a run's log, e.g. ``compiled 4 blocks (3 types) on cuda: 3 graphs``."""
        line = (f"compiled {len(self.blocks)} blocks ({len(self.groups)} types) on {self.device}: "
                f"{sum(g.compiles for g in self.groups)} graphs")
        if self.fallbacks:
            line += "; eager after a failure: " + ", ".join(self.fallbacks)
        return line


def blocks_device(mods) -> torch.device:
    """Where blocks live: their first parameter's device (CPU for blocks without parameters)."""
    first = next((p for m in mods for p in m.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _make_settings(backend, mode, options, fullgraph, dynamic) -> _Settings:
    try:
        settings = _Settings(backend, mode, tuple(sorted((options or {}).items())), bool(fullgraph), dynamic,
                             sdpa_state())
        hash(settings)
    except TypeError as exc:
        raise ValueError(f"compile options must be hashable values ({exc})") from None
    return settings


def compile_blocks(blocks, *, device=None, backend: Any = "inductor", mode: str | None = None,
                   options: dict | None = None, fullgraph: bool = True,
                   dynamic: bool | None = False) -> CompileReport:
    """Compile each block of ``blocks`` in place (regional compilation, see the module docstring);
    returns a live ``CompileReport``.

    ``blocks``: an nn.Sequential (a pipeline stage's module), a list of modules, or a model with
    ``blocks()``. ``device``: where the blocks run (default: their first parameter's device); with
    the inductor backend, a device where ``compile_unavailable_reason`` has a reason raises
    CompileUnavailableError. ``backend``: any ``torch.compile`` backend (a name or a callable; tests
    pass one that raises). ``mode`` / ``options``: inductor's (``mode="reduce-overhead"`` is refused:
    CUDA graphs replay captured weight addresses, which the 2bw swap changes); ``options`` go on top
    of the device's defaults (compile_support.DEVICE_OPTIONS: on CUDA, concatenations as kernels
    of their own). ``fullgraph``: a graph
    break is a compile failure (falls back with a warning) rather than a silently split block.
    ``dynamic=False``: one graph per shape (see Recompilation). Compiling an already compiled block
    again replaces its settings."""
    mods = _as_blocks(blocks)
    if mode in _CUDAGRAPH_MODES:
        raise ValueError(f"mode={mode!r} captures CUDA graphs, which replay the weight addresses seen at "
                         "capture; the 2bw stage swaps weight buffers between versions. Use mode=None "
                         "or 'max-autotune' (compiled without CUDA graphs here)")
    if options and backend != "inductor":
        raise ValueError("options= are inductor options; pass them only with backend='inductor'")
    device = _device(device if device is not None else blocks_device(mods))
    if backend == "inductor":
        reason = compile_unavailable_reason(device)
        if reason is not None:
            raise CompileUnavailableError(f"cannot compile blocks for {device}: {reason}")
        options = device_inductor_options(device, options)
    settings = _make_settings(backend, mode, options, fullgraph, dynamic)
    groups: dict[int, _Group] = {}
    for i, module in enumerate(mods):
        own = module.__dict__.get("forward")
        if own is not None and not isinstance(own, _CompiledForward):
            raise ValueError(f"block {i} ({type(module).__name__}) has its own forward attribute "
                             "(patched by other code); compiling would bypass it")
        group = _group(type(module), settings)
        module.forward = _CompiledForward(module, group)  # nn.Module.__setattr__: a plain attribute
        groups[id(group)] = group
    return CompileReport(str(device), [type(m).__qualname__ for m in mods], list(groups.values()))


def uncompile(blocks) -> None:
    """Undo ``compile_blocks`` (and ``regions.compile_regions``): the blocks run their eager
    forward again."""
    for module in _as_blocks(blocks):
        if is_compiled(module):
            del module.__dict__["forward"]
        module.__dict__.pop(REGION_MARK, None)


__all__ = ["MODES", "CompileUnavailableError", "CompileReport", "compile_unavailable_reason", "resolve_compile",
           "inductor_mode", "compile_blocks", "uncompile", "is_compiled"]
