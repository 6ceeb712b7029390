"""Concatenations as kernels that write their parts in place, on torch releases whose inductor
cannot be asked for them: ``max_pointwise_cat_inputs=0`` there builds what newer releases build
with both ``max_pointwise_cat_inputs=0`` and ``max_complex_pointwise_cat_inputs=0``.

Why. Inductor lowers a concatenation on a GPU in one of two ways: one *pointwise* kernel over the
whole output whose every element picks its input by masked loads, or a ``ConcatKernel``, where each
input is computed straight into its slice of the output by a kernel of its own. When the inputs are
themselves computed (the rotary backward of q and k, whose gradients and v's are concatenated for
the stacked q/k/v product's backward), the pointwise form works out every branch's indices for
every element: at smollm-360m that kernel took 85 us per block where its bytes need about 20
(docs/gpu.md). Releases with ``max_complex_pointwise_cat_inputs`` build the other form when both
options are 0; older ones (torch 2.11 among them) fuse up to eight inputs of any complexity
whatever ``max_pointwise_cat_inputs`` says, a limit written into the lowering itself.

What. On such an older torch, compiled blocks whose options set ``max_pointwise_cat_inputs`` to 0
(models/compile.py calls ``install_if_needed``) get a lowering of ``aten.cat`` in front of
inductor's own: while that option is 0 and ``force_pointwise_cat`` is off, a concatenation of two
or more inputs of one dtype and rank on a GPU becomes a ``ConcatKernel`` (what inductor itself
builds on a CPU); anything else goes to inductor's lowering unchanged. A concatenation copies its
inputs exactly; only where the pointwise form would have been fused into a pointwise consumer can
the result differ, by the rounding of the now materialised 16-bit output. The lowering is
process-wide once installed but acts only under that option value, and the compiles that ask for
it carry a marker in inductor's cache key (``CACHE_MARK``), so that a graph compiled without the
lowering is never served to them from the cache, nor theirs to others.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

OPTION = "max_pointwise_cat_inputs"
NEWER_OPTION = "max_complex_pointwise_cat_inputs"  # where inductor builds ConcatKernels itself
CACHE_OPTION = "post_grad_custom_post_pass"  # the config slot whose pass's uuid enters the cache key

LOWERED_BY_INDUCTOR = ("cpu",)
"""Devices whose concatenations inductor lowers as ConcatKernels itself (left to it)."""

_installed: list = []  # inductor's aten.cat lowering while ours is in front of it (one entry)


def needed(options: dict, known=None) -> bool:
    """Whether compiling with inductor ``options`` needs the lowering here: they set OPTION to 0
    and this torch's inductor (``known``: its option names) has OPTION but not NEWER_OPTION."""
    if dict(options or {}).get(OPTION) != 0:
        return False
    if known is None:
        from torch._inductor import config

        known = config.get_config_copy()
    return OPTION in known and NEWER_OPTION not in known


def install_if_needed(patches: dict) -> bool:
    """For a compile with inductor config ``patches`` (changed in place): where ``needed``,
    ``install()`` and put ``CACHE_MARK`` in the cache-key slot (unless the patches fill it with a
    pass of their own). Returns whether the lowering is installed."""
    if needed(patches):
        try:
            install()
            mark = cache_mark()
        except (ImportError, AttributeError, KeyError) as exc:  # an inductor laid out otherwise
            warnings.warn(f"asyncpp: max_pointwise_cat_inputs=0: this torch's inductor lowering of aten.cat "
                          f"could not be extended ({type(exc).__name__}: {exc}); its own lowering runs",
                          stacklevel=2)
            return False
        if patches.get(CACHE_OPTION) is None:
            patches[CACHE_OPTION] = mark
    return bool(_installed)


def install() -> None:
    """Put ``concat_in_place`` in front of inductor's ``aten.cat`` lowering under every key that
    holds it (the overload and the packet), once per process."""
    if _installed:
        return
    from torch._inductor import lowering

    original = lowering.lowerings[torch.ops.aten.cat.default]
    for key in [k for k, fn in lowering.lowerings.items() if fn is original]:
        lowering.lowerings[key] = _lowering
    _installed.append(original)


def installed() -> bool:
    """Whether the lowering is in front of inductor's in this process."""
    return bool(_installed)


def uninstall() -> None:
    """Inductor's own lowering again (tests)."""
    if _installed:
        from torch._inductor import lowering

        original = _installed.pop()
        for key in [k for k, fn in lowering.lowerings.items() if fn is _lowering]:
            lowering.lowerings[key] = original


def _lowering(inputs, dim=0):
    """The installed ``aten.cat`` lowering: inductor's is looked up at each call."""
    return concat_in_place(_installed[0], inputs, dim)


def takes(inputs, dim) -> bool:
    """Whether ``concat_in_place`` builds a ConcatKernel for these inputs (IR nodes) under the
    current inductor config: OPTION at 0, pointwise cats not forced, two or more inputs on a GPU
    (inductor's CPU lowering builds ConcatKernels itself), one dtype and rank, an int dim."""
    from torch._inductor import config

    if getattr(config, OPTION, None) != 0 or getattr(config, "force_pointwise_cat", False):
        return False
    if not isinstance(inputs, (list, tuple)) or len(inputs) < 2 or not isinstance(dim, int):
        return False
    if not all(hasattr(x, name) for x in inputs for name in ("get_device", "get_dtype", "get_size")):
        return False  # not tensors (IR nodes): inductor's to handle
    device = inputs[0].get_device()
    if device is None or device.type in LOWERED_BY_INDUCTOR:
        return False
    first = inputs[0]
    rank = len(first.get_size())
    return rank > 0 and all(x.get_dtype() == first.get_dtype() and len(x.get_size()) == rank
                            and x.get_device() == device for x in inputs)


def concat_in_place(original, inputs, dim=0):
    """A ConcatKernel where ``takes(inputs, dim)``, else ``original(inputs, dim)``."""
    if not takes(inputs, dim):
        return original(inputs, dim)
    from torch._inductor import ir

    rank = len(inputs[0].get_size())
    return ir.TensorBox(ir.ConcatKernel.create(list(inputs), dim % rank))


_MARK: list = []  # the one CACHE_MARK instance, made at first use (inductor imported by then)


def cache_mark():
    """``CACHE_MARK``: a post-grad pass that changes nothing and whose uuid (a hash of this file)
    puts the lowering into inductor's cache key."""
    if not _MARK:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        class ConcatLoweringMark(CustomGraphPass):
            def __call__(self, graph: torch.fx.graph.Graph) -> None:
                return None

            def uuid(self) -> Optional[Any]:
                return get_hash_for_files((__file__,))

        _MARK.append(ConcatLoweringMark())
    return _MARK[0]


__all__ = ["OPTION", "NEWER_OPTION", "CACHE_OPTION", "LOWERED_BY_INDUCTOR", "needed", "install_if_needed",
           "install", "installed", "uninstall", "takes", "concat_in_place", "cache_mark"]
