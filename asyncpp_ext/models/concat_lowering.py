"""``max_pointwise_cat_inputs=0`` meaning "every concatenation as kernels that write their parts in
place" on every torch, as it does on torch releases that have ``max_complex_pointwise_cat_inputs``.

Why. Inductor lowers a concatenation on a GPU in one of two ways: one *pointwise* kernel over the
whole output whose every element picks its input by masked loads, or a ``ConcatKernel``, where each
input is computed straight into its slice of the output by a kernel of its own. When the inputs are
themselves computed (the rotary backward of q and k, whose gradients and v's are concatenated for
the stacked q/k/v product's backward), the pointwise form works out every branch's indices for
every element: at smollm-360m that kernel took 85 us per block where its bytes need about 20
(docs/gpu.md). ``--inductor-option max_pointwise_cat_inputs=0`` asks for the other form. Releases
with ``max_complex_pointwise_cat_inputs`` (set to 0 as well) honour it; older ones fuse up to eight
inputs of any complexity regardless of the option, a limit written into the lowering itself.

What. On such an older torch, compiled blocks whose options set ``max_pointwise_cat_inputs`` to 0
(``install_if_needed``) get a lowering of ``aten.cat`` in front of inductor's own: while that option
is 0 and ``force_pointwise_cat`` is off, a concatenation of two or more inputs of one dtype and rank
on a GPU becomes a ``ConcatKernel`` (what inductor itself builds on a CPU, and what the newer
releases build with both options at 0); anything else goes to inductor's lowering unchanged. The
values are the same either way (a concatenation copies exactly); only the kernels differ. The
lowering is process-wide but acts only under that option value, which newer releases give the
same meaning.
"""
from __future__ import annotations

import functools

import torch

OPTION = "max_pointwise_cat_inputs"
NEWER_OPTION = "max_complex_pointwise_cat_inputs"  # present where inductor honours OPTION = 0 itself

LOWERED_BY_INDUCTOR = ("cpu",)
"""Devices whose concatenations inductor lowers as ConcatKernels itself (left to it)."""

_installed: list = []  # the replaced lowering, once installed (one entry)


def needed(options: dict, known=None) -> bool:
    """Whether compiling with inductor ``options`` needs the lowering here: they set OPTION to 0
    and this torch's inductor (``known``: its option names) has OPTION but not NEWER_OPTION."""
    if dict(options or {}).get(OPTION) != 0:
        return False
    if known is None:
        from torch._inductor import config

        known = config.get_config_copy()
    return OPTION in known and NEWER_OPTION not in known


def install_if_needed(options: dict) -> bool:
    """``install()`` when ``needed(options)``; returns whether the lowering is installed."""
    if needed(options):
        install()
    return bool(_installed)


def install() -> None:
    """Put ``concat_in_place`` in front of inductor's ``aten.cat`` lowering (once per process)."""
    if _installed:
        return
    from torch._inductor import lowering

    target = torch.ops.aten.cat.default
    original = lowering.lowerings[target]
    lowering.lowerings[target] = functools.partial(concat_in_place, original)
    _installed.append(original)


def uninstall() -> None:
    """Inductor's own lowering again (tests)."""
    if _installed:
        from torch._inductor import lowering

        lowering.lowerings[torch.ops.aten.cat.default] = _installed.pop()


def takes(inputs, dim) -> bool:
    """Whether ``concat_in_place`` builds a ConcatKernel for these inputs (IR nodes) under the
    current inductor config: OPTION at 0, pointwise cats not forced, two or more inputs on a GPU
    (inductor's CPU lowering builds ConcatKernels itself), one dtype and rank, an int dim."""
    from torch._inductor import config

    if getattr(config, OPTION, None) != 0 or config.force_pointwise_cat:
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
    """The ``aten.cat`` lowering: a ConcatKernel where ``takes(inputs, dim)``, else ``original``."""
    if not takes(inputs, dim):
        return original(inputs, dim)
    from torch._inductor import ir

    rank = len(inputs[0].get_size())
    return ir.TensorBox(ir.ConcatKernel.create(list(inputs), dim % rank))


__all__ = ["OPTION", "NEWER_OPTION", "LOWERED_BY_INDUCTOR", "needed", "install_if_needed", "install", "uninstall",
           "takes", "concat_in_place"]
