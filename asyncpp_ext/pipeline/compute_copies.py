"""16-bit compute copies of a module's linear weights, made once per weight version instead of
cast by autocast in every microbatch (the "bf16 compute copies", docs/design.md §2.13).

Under bf16 autocast every ``nn.Linear`` call casts its float32 weight (and bias) to bf16, and its
backward casts the bf16 weight gradient back to float32 before autograd adds it into ``.grad``: per
weight and microbatch a cast kernel forward, a cast kernel backward and an add. A small model on a
GPU is bound by such launches (docs/gpu.md: smollm-135m launches ~60 kernels per block and
microbatch). ``ComputeCopies`` keeps one bf16 copy of those weights per weight version,
refreshed once when the version's float32 values change, and a *compute module* that runs on
them: a structural copy of the module whose ``nn.Linear`` weights and biases are the bf16 copies
and whose every other parameter and buffer is the module's own object (shared, not copied), plus,
on each module that stacks linear layers in one product when compiled (q/k/v, gate/up), one
parameter over their copies stacked (``ComputeCopies._stack``). After each backward the copies'
bf16 gradients are added into the float32 ``.grad`` of the weights they copy by one multi-tensor
kernel (``optim._kernels.accumulate``).

Exact: the values are those autocast gives. Autocast rounds the float32 weight to bf16 for the
matrix product (the copy holds that rounding), its product yields the bf16 weight gradient, which
the cast's backward widens to float32 exactly and autograd adds into ``.grad`` in float32; here the
same bf16 gradient is added into the same float32 ``.grad`` (a mixed add computes in float32:
the same sum, bit for bit; tests/test_compute_copies.py checks it against autocast).

What is copied: parameters owned only by modules of type exactly ``nn.Linear`` (a subclass may use
its weight otherwise), float32, trainable, outside ``exclude`` (the fused head loss reads its
projection weight itself and keeps a float32 gradient). A parameter also used by another kind of
module (an embedding table tied to an output projection) stays float32: an embedding lookup of a
bf16 table would change the activations.

Use (one engine step)::

    copies.refresh()                     # after the weights changed (optimizer step, version swap)
    for x, y in microbatches:
        loss_fn(copies.module, x, y).backward()   # under bf16 autocast
        copies.accumulate()              # copies' gradients -> the float32 .grad
"""
from __future__ import annotations

import copy
import functools
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..models.graphs import GRADS_TAKEN  # the copies' ids, set on the compute module
from ..models.llama import STACKED_PRODUCT, STACKED_PROJECTIONS, STACKED_WEIGHT
from ..optim import _kernels as K
from .flat_buffers import views_of


def copied_parameters(module: nn.Module, exclude: Iterable[nn.Module] = (),
                      every: bool = False) -> list[nn.Parameter]:
    """The parameters of ``module`` a compute copy replaces (see the module docstring), in
    ``module.parameters()`` order. ``every``: all float32 trainable parameters (``--dtype
    bf16-params``: the whole computation in 16 bits), ``exclude`` then ignored."""
    if every:
        return [p for p in module.parameters() if p.requires_grad and p.dtype == torch.float32]
    owners: dict[int, list[nn.Module]] = {}
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(sub)
    excluded = {id(p) for m in exclude for p in m.parameters()}
    return [p for p in module.parameters()
            if p.requires_grad and p.dtype == torch.float32 and id(p) not in excluded
            and all(type(m) is nn.Linear for m in owners[id(p)])]


class ComputeCopies:
    """A compute module over ``dtype`` copies of ``module``'s linear weights; see the module
    docstring. ``module`` keeps its float32 parameters (the optimizer's, the checkpoint's)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.bfloat16,
                 exclude: Iterable[nn.Module] = (), every: bool = False, fuse_weight_gradients: bool = False):
        self.masters = copied_parameters(module, exclude, every)
        numel = sum(p.numel() for p in self.masters)
        device = self.masters[0].device if self.masters else torch.device("cpu")
        self.flat = torch.empty(numel, dtype=dtype, device=device)  # every copy views it
        memo: dict[int, object] = {}
        for p in module.parameters():  # shared: the same objects (their grads accumulate as before)
            memo[id(p)] = p
        for b in module.buffers():
            memo[id(b)] = b
        self.copies: list[nn.Parameter] = []
        for p, view in zip(self.masters, views_of(self.masters, self.flat)):
            c = nn.Parameter(view, requires_grad=True)
            memo[id(p)] = c
            self.copies.append(c)
        self.module = copy.deepcopy(module, memo)
        # (stacked weight, the masters of its rows): see _stack
        self.stacked: list[tuple[nn.Parameter, list[nn.Parameter]]] = self._stack()
        setattr(self.module, GRADS_TAKEN,
                frozenset(id(c) for c in self.copies) | frozenset(id(s) for s, _ in self.stacked))
        # whether our kernel adds the gradients (decided once: the device does not change)
        self.fused = dtype == torch.bfloat16 and K.kernels_usable(self.flat)
        # --gradient-accumulation-fusion: the float32 gradients the products add into (main_grad.py),
        # one per master; ``_own_grads``: this object's buffer (zeroed by begin_step), else the masters'
        # own .grad (a pipeline stage's flat gradient buffer, which the stage zeroes)
        self.main_grads: Optional[list[torch.Tensor]] = None
        self._own_grads: Optional[torch.Tensor] = None
        # data parallelism's early gradients (announce_final_grads): set for a step's last backward
        self.final_backward = False
        self._on_final: Optional[Callable[[nn.Parameter], None]] = None
        self._announced: set[int] = set()  # ids of the masters announced in this final backward
        # each fused product's gradient (by main_grad.added_into_key) and the masters it spans
        self._fused: dict[tuple[int, int], tuple[torch.Tensor, list[nn.Parameter]]] = {}
        if fuse_weight_gradients:
            if dtype != torch.bfloat16:
                raise ValueError(f"gradient-accumulation fusion adds bf16 products; these copies are {dtype}")
            self._fuse_weight_gradients()

    def __len__(self) -> int:
        return len(self.copies)

    def _stack(self) -> list[tuple[nn.Parameter, list[nn.Parameter]]]:
        """Give each module of the compute module that stacks linear layers in its compiled forward
        (a class attribute ``stacked_projections``: models/llama.py, q/k/v and gate/up) a parameter
        ``stacked_weight`` over their copies, which lie side by side in ``flat`` in that order (the
        masters' order): the stacked product's weight without a concatenation per call (at
        smollm-360m 12.9 MB per layer and microbatch to read and write). Its gradient is theirs,
        row blocks in order (accumulate). A group whose layers are not all bias-free copies of
        one input width, side by side, gets none (fused_linear then concatenates their weights)."""
        index = {id(c): i for i, c in enumerate(self.copies)}
        stacked = []
        for owner in self.module.modules():
            names = getattr(type(owner), STACKED_PROJECTIONS, ())
            layers = [getattr(owner, n, None) for n in names]
            if not layers or not all(type(m) is nn.Linear and m.bias is None
                                     and m.in_features == layers[0].in_features for m in layers):
                continue
            at = [index.get(id(m.weight)) for m in layers]
            if None in at or at != list(range(at[0], at[0] + len(at))):
                continue
            start = self.copies[at[0]].storage_offset() - self.flat.storage_offset()  # its place in flat
            rows = sum(m.out_features for m in layers)
            view = self.flat[start:start + rows * layers[0].in_features].view(rows, layers[0].in_features)
            weight = nn.Parameter(view, requires_grad=True)
            owner.register_parameter(STACKED_WEIGHT, weight)
            stacked.append((weight, [self.masters[i] for i in at]))
        return stacked

    def _fuse_weight_gradients(self) -> None:
        """Make the compute module's bias-free linear layers over copies, and its stacked products,
        add their weight gradients into the masters' float32 gradients themselves (main_grad.py).
        The gradients: the masters' ``.grad`` where every master has one (a stage points them into
        its flat buffer before it makes copies), else views of one buffer of this object's."""
        from .main_grad import MainGradLinear, MainGradProduct, added_into_key

        if self.masters and all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.is_contiguous()
                                for p in self.masters):
            self.main_grads = [p.grad for p in self.masters]
        else:
            self._own_grads = torch.zeros(sum(p.numel() for p in self.masters), dtype=torch.float32,
                                          device=self.flat.device)
            self.main_grads = views_of(self.masters, self._own_grads)
        index = {id(c): i for i, c in enumerate(self.copies)}
        for sub in self.module.modules():
            if type(sub) is nn.Linear and sub.bias is None and id(sub.weight) in index:
                sub.__class__ = MainGradLinear
                sub.main_grad = self.main_grads[index[id(sub.weight)]]
                self._fused.setdefault(added_into_key(sub.main_grad),
                                       (sub.main_grad, [self.masters[index[id(sub.weight)]]]))
        for owner in self.module.modules():
            weight = getattr(owner, STACKED_WEIGHT, None)
            if weight is None:
                continue
            at = [index[id(getattr(owner, n).weight)] for n in getattr(type(owner), STACKED_PROJECTIONS)]
            rows = [self.main_grads[i] for i in at]
            side_by_side = all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
                               and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                               for a, b in zip(rows, rows[1:]))
            if side_by_side:  # else the stacked product's gradient goes the unfused way (accumulate)
                grad = rows[0].new_empty(0).set_(rows[0].untyped_storage(), rows[0].storage_offset(), weight.shape)
                owner.add_module(STACKED_PRODUCT, MainGradProduct(grad))
                self._fused.setdefault(added_into_key(grad), (grad, [self.masters[i] for i in at]))

    def announce_final_grads(self, on_final: Callable[[nn.Parameter], None]) -> None:
        """For data parallelism (data_parallel.py), whose gradient buckets start their all-reduce
        inside a step's last backward as their weights' gradients become final, from hooks on
        those weights: a weight computed on a copy gets no gradient of its own from autograd. So
        in a backward run with ``final_backward`` set, each copy's (and stacked weight's) gradient
        goes into its masters' float32 ``.grad`` as soon as autograd has it (a hook on the copy;
        ``accumulate`` then has nothing left of it) and ``on_final(master)`` says that master's
        gradient is complete; with fused weight gradients (main_grad.py) the product that adds a
        layer's gradient announces its masters right after (``main_grad.after_add_into``)."""
        from .main_grad import after_add_into

        self._on_final = on_final
        for c, p in zip(self.copies, self.masters):
            c.register_post_accumulate_grad_hook(functools.partial(self._final_gradient, [p]))
        for weight, masters in self.stacked:
            weight.register_post_accumulate_grad_hook(functools.partial(self._final_gradient, masters))
        for main_grad, _ in self._fused.values():
            after_add_into(main_grad, self._fused_gradient)

    def start_final_backward(self, final: bool) -> None:
        """Before each backward: whether it is the step's last (see announce_final_grads); and
        False after it (a 2bw stage's two sets of copies share the gradients their products add
        into, so the set not computing must not announce)."""
        self.final_backward = final
        self._announced = set()

    def _final_gradient(self, masters: list[nn.Parameter], weight: nn.Parameter) -> None:
        if not self.final_backward or self._on_final is None:
            return  # accumulate adds it after the backward
        if weight.grad is None:  # a fused product's copy: autograd's hook runs with no gradient
            return
        self._check_not_announced(masters, "through its compute copy and its stacked product (an eager "
                                           "and a compiled use of one block); use --no-compute-copies or --dp 1")
        self._add(_row_blocks(weight.grad, masters))
        weight.grad = None
        self._announce(masters)

    def _fused_gradient(self, key: tuple[int, int]) -> None:
        if self.final_backward and self._on_final is not None:
            masters = self._fused[key][1]
            self._check_not_announced(masters, "by a fused product called twice in one backward (a layer used "
                                               "twice); drop --gradient-accumulation-fusion or use --dp 1")
            self._announce(masters)

    def _check_not_announced(self, masters: list[nn.Parameter], how: str) -> None:
        if any(id(p) in self._announced for p in masters):  # its bucket may be summing without this part
            raise RuntimeError(f"a weight's gradient grew after it was announced complete to data parallelism, {how}")

    def _announce(self, masters: list[nn.Parameter]) -> None:
        for p in masters:
            self._announced.add(id(p))
            self._on_final(p)

    def begin_step(self) -> None:
        """Before a step's first backward: with fused weight gradients into a buffer of this
        object's, zero it and make it the masters' ``.grad`` again (an optimizer's
        ``zero_grad(set_to_none=True)`` drops them); otherwise nothing."""
        if self._own_grads is None:
            return
        self._own_grads.zero_()
        for p, g in zip(self.masters, self.main_grads):
            p.grad = g

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the masters' current values into the copies (once per weight change)."""
        if self.copies:
            torch._foreach_copy_(self.copies, self.masters)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the copies' gradients of the last backward into the masters' float32 ``.grad``
        (a master without one gets the widened gradient), and clear the copies' ``.grad``; a
        stacked weight's gradient goes to its rows' masters, one row block each. One fused kernel
        adds them all (``optim._kernels.accumulate``: torch's mixed-dtype ``_foreach_add_`` would
        launch one kernel per tensor on a GPU); tensors it does not take (not contiguous, another
        dtype), or all of them where a build has no kernels for the device, go through torch,
        which gives the same sums."""
        if self.main_grads is not None and any(p.grad is not g for p, g in zip(self.masters, self.main_grads)):
            raise RuntimeError("the fused weight gradients went into tensors that are no longer the weights' "
                               ".grad (zero_grad(set_to_none=True) or a new .grad since the step began): call "
                               "begin_step() after zero_grad, before the step's first backward")
        pairs = []
        for c, p in zip(self.copies, self.masters):
            if c.grad is not None:
                pairs.append((c.grad, p))
                c.grad = None
        stacked = []  # a stacked weight's gradient (a compiled block's), row block by row block
        for weight, masters in self.stacked:
            if weight.grad is not None:
                stacked += _row_blocks(weight.grad, masters)
                weight.grad = None
        if {id(p) for _, p in pairs} & {id(p) for _, p in stacked}:
            # a master given a gradient both ways in one backward (an eager and a compiled use of
            # one block): its copy's first, then the stacked one's, each added in float32
            self._add(pairs)
            self._add(stacked)
        else:
            self._add(pairs + stacked)  # one fused call

    def _add(self, pairs: list) -> None:
        """Each (16-bit gradient, master) pair's gradient into the master's ``.grad``."""
        fused_into, fused, into, grads, fresh = [], [], [], [], []
        for g, p in pairs:
            if p.grad is None:
                fresh.append((p, g))
            elif g.dtype == self.flat.dtype and g.is_contiguous() and p.grad.is_contiguous():
                fused_into.append(p.grad)
                fused.append(g)
            else:
                into.append(p.grad)
                grads.append(g)
        if fused and self.fused:
            K.accumulate(fused_into, fused)
        else:
            into, grads = into + fused_into, grads + fused
        if into:
            torch._foreach_add_(into, grads)
        if fresh:  # the first backward after zero_grad(set_to_none=True): the widened gradients
            self._widen_into_new_grads(fresh)

    def _widen_into_new_grads(self, fresh: list) -> None:
        """Give each master a ``.grad`` holding its copy's gradient widened (exactly, -0.0 kept,
        as autograd's widening cast would): views of one new buffer, in the masters' order,
        filled by one multi-tensor copy (a single launch on a GPU) instead of a cast and an
        allocation per tensor."""
        order = {id(p): i for i, p in enumerate(self.masters)}
        fresh = sorted(fresh, key=lambda pair: order[id(pair[0])])
        masters = [p for p, _ in fresh]
        buffer = torch.empty(sum(p.numel() for p in masters), dtype=masters[0].dtype, device=masters[0].device)
        views = views_of(masters, buffer)
        torch._foreach_copy_(views, [g for _, g in fresh])
        for (p, _), view in zip(fresh, views):
            p.grad = view


def _row_blocks(grad: torch.Tensor, masters: list[nn.Parameter]) -> list[tuple[torch.Tensor, nn.Parameter]]:
    """(gradient, master) pairs of a weight over ``masters``' rows: a copy's one master takes it
    whole, a stacked weight's masters take their row blocks in order."""
    if len(masters) == 1:
        return [(grad, masters[0])]
    return list(zip(grad.split([p.shape[0] for p in masters]), masters))


class ReplicaCopies:
    """A pipeline stage's compute copies: one set per weight-version replica (= flat buffer), each
    refreshed at the first use of the version its replica holds (the buffer is final by then: the
    optimizer step that wrote it and the tied values' install come first)."""

    def __init__(self, sets: list[ComputeCopies]):
        self.sets = sets
        self.hold: list[Optional[int]] = [None] * len(sets)  # the version each set was refreshed for

    @classmethod
    def build(cls, replicas, dtype: Optional[torch.dtype], enabled: bool, exclude_last: bool,
              every: bool = False, fuse_weight_gradients: bool = False) -> Optional["ReplicaCopies"]:
        """Copies of every replica, or None (off, float32, nothing to copy). ``exclude_last``
        leaves the replicas' last block (the fused head loss's) as it is; ``every`` copies every
        parameter (``--dtype bf16-params``); ``fuse_weight_gradients``: the products add into the
        replicas' ``.grad`` (main_grad.py), which must exist (the stage's flat gradient buffer)."""
        sets = [maybe_compute_copies(r, dtype, enabled,
                                     exclude=[list(r.children())[-1]] if exclude_last else [], every=every,
                                     fuse_weight_gradients=fuse_weight_gradients)
                for r in replicas]
        return cls(sets) if sets and all(s is not None for s in sets) else None

    def module_for(self, k: int, version: int, replica: nn.Module) -> nn.Module:
        """The compute module of replica ``k``, which holds ``version``."""
        copies = self.sets[k]
        if self.hold[k] != version:
            copies.refresh()
            copies.module.train(replica.training)
            self.hold[k] = version
        return copies.module

    def invalidate(self) -> None:
        """The buffers changed under the copies (a checkpoint was loaded)."""
        self.hold = [None] * len(self.sets)

    def nbytes(self) -> int:
        return sum(s.flat.numel() * s.flat.element_size() for s in self.sets)


def maybe_compute_copies(module: nn.Module, dtype: Optional[torch.dtype], enabled: bool,
                         exclude: Iterable[nn.Module] = (), every: bool = False,
                         fuse_weight_gradients: bool = False) -> Optional[ComputeCopies]:
    """Compute copies for a run in ``dtype`` (autocast's; None = float32: nothing to copy), or
    None when off or when ``module`` has nothing to copy."""
    if not enabled or dtype is None:
        return None
    copies = ComputeCopies(module, dtype, exclude, every, fuse_weight_gradients)
    return copies if len(copies) else None


__all__ = ["ComputeCopies", "ReplicaCopies", "copied_parameters", "maybe_compute_copies"]
