"""The LM head's projection and its mean cross entropy without materialising the (N, V) logits.

``loss = mean_i [logsumexp_j(h_i . w_j + b_j) - (h_i . w_{t_i} + b_{t_i})]`` over the rows i whose
target is not ``ignore_index``. The plain path (``BlockModel.loss(head(x), t)``) builds the logits,
their fp32 log-probabilities and the gradients of both: for SmolLM (V = 49152) at an 8 x 1024
micro-batch that is 1.6 GB per copy. Here the rows are cut into chunks, and the forward forms each
chunk's logits, its ``softmax - onehot`` and their products with the weight and the input while the
chunk is at hand, so only one chunk's logits exist at a time (the backward only scales the sums).

Which kernel runs ("fused" mode): Liger-Kernel's fused linear cross entropy on CUDA when the
``fused-loss`` extra is installed, else cut-cross-entropy on CUDA when installed, else the chunked
implementation below (any device). ``resolve_head_loss`` picks plain or fused for a run.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import time
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .base import BlockModel
from .z_loss import check_kernel_z_loss, check_z_loss, plain_loss

HEAD_LOSS_MODES = ("auto", "fused", "plain")
KERNELS = ("liger", "cce", "chunked")
# The only library kernel the ``fused-loss`` extra installs is Liger's (pyproject.toml says why).
_INSTALL = {"liger": "pip install 'asyncpp_ext[fused-loss]' (liger-kernel)",
            "cce": "pip install cut-cross-entropy"}

FUSED_VOCAB_THRESHOLD = 8192
"""``auto`` fuses from this vocabulary size on. At V = 8192 an 8 x 1024 micro-batch's fp32 logits
are 268 MB and plain keeps about three such buffers (logits, log-probs, their gradient) at its peak,
as much as the rest of a small model's activations; below it (the byte-level GPT at 256, llama-tiny)
they are a few MB, so chunking would only add the recomputed matmul, and those runs keep their exact
(golden) numbers."""

CHUNK_BYTES = 384 * 2**20
"""Default budget of the (rows, V) buffers one chunk holds at once (logits, their gradient, and on
the eager path the fp32 temporaries): ~0.4 GB, well under plain's three N x V fp32 buffers once N
exceeds a few thousand rows. The rows per chunk follow from the bytes the chunk's path holds per
logit (``_ChunkPasses.logit_bytes``): 682 rows at V = 49152 eagerly (CPU), 2048 compiled in bf16
(CUDA) -- there the larger chunk means fewer chunks per microbatch, each a few host calls, and a
``g @ W`` product whose (rows, C) output has enough tiles to fill the GPU."""

EAGER_LOGIT_BYTES = 12
"""Bytes per (row, vocabulary) entry the eager passes hold at their peak, counted as the four
buffers' sum for 16-bit logits: the logits (2), their fp32 upcast (4), the logsumexp's fp32
temporary (4), the gradient (2). An upper bound (measured on CPU: 10 for 16-bit logits, 8 for
fp32, whose upcast is the logits themselves), and the one that keeps the CPU chunk at 682 rows at
V = 49152, the chunking every earlier CPU figure was measured with."""


def default_chunk_rows(vocab_size: int, logit_bytes: int = EAGER_LOGIT_BYTES) -> int:
    """Rows per chunk so that one chunk's (rows, V) buffers, ``logit_bytes`` per entry, take at
    most ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (logit_bytes * vocab_size))


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype F.linear would compute in on ``device`` under the current autocast, else None."""
    if device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _no_autocast(device: torch.device):
    """A context with autocast off on ``device`` (our casts are explicit)."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def addmm_writes_fp32(device, dtype: torch.dtype) -> bool:
    """See ``_addmm_writes_fp32``; ``device`` as any spelling of it ("cuda" = the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _addmm_writes_fp32(device, dtype)


@functools.lru_cache(maxsize=None)
def _addmm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's ``addmm(acc, a, b, out_dtype=float32, out=acc)`` takes ``dtype``
    operands with an fp32 accumulator on ``device`` (newer releases; older ones refuse the
    argument or the mixed dtypes). Asked once, on tiny tensors, so that an error in training (out
    of memory, say) is never taken for a missing feature and a run never switches paths midway."""
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError):
        return False
    return True  # (no read of the result: the first call may come in a CUDA graph's warm-up)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b. For 16-bit a, b on CUDA the GEMM writes fp32 into acc itself where
    torch can: no V x C temporary and no extra pass over acc per chunk (that pass cost as much as
    the matmul at smollm's head). Elsewhere the product is rounded to a's dtype, then added in
    fp32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and addmm_writes_fp32(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


def _chunk_stats(logits: torch.Tensor, t: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a chunk's logits (rows, V) and targets (rows, 1): the logsumexp, and the sum over
    the valid rows of the target's negative log-likelihood, both in fp32 whatever the logits' dtype
    (what F.cross_entropy computes after autocast's upcast)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    return lse, torch.where(valid, lse - x.gather(1, t).squeeze(1), 0.0).sum()


def _chunk_grad(logits: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype,
                z_loss: float = 0.0) -> torch.Tensor:
    """softmax - onehot(t) of a chunk, in ``dtype``: exp(logit - lse) from the saved logsumexp,
    computed in fp32, 1 taken off at the target in fp32 (in bf16 p_t - 1 would lose its digits as
    p_t nears 1), then rounded once to the matmul dtype, as plain autocast rounds its gradient.
    Compiled, the one-hot is a comparison with the column index, so that the whole pass is one
    elementwise kernel from the 16-bit logits to the 16-bit gradient (a scatter is a mutation
    inductor cannot fuse: it wrote an fp32 (rows, V) buffer, scattered into it, then converted it
    in a second kernel -- three times the bytes, and that buffer on top of the chunk's memory).
    Eagerly the scatter writes in place, where the comparison would make a (rows, V) mask and a
    promoted temporary. Both give p - 1 at the target and p + (-0) = p elsewhere, bit for bit.
    With a ``z_loss`` coefficient z the softmax is first scaled by 1 + 2 z lse per row: the
    derivative of z lse^2 adds 2 z lse p (models/z_loss.py says what the term is); z = 0 leaves the
    pass as it was."""
    g = logits.float().sub_(lse).exp_()
    if z_loss:
        g.mul_(lse.mul(2.0 * z_loss).add_(1.0))
    if torch.compiler.is_compiling():
        onehot = torch.arange(g.shape[1], device=g.device) == t
        return g.add_(onehot, alpha=-1).to(dtype)
    g.scatter_add_(1, t, torch.full_like(lse, -1.0))
    return g.to(dtype)


class _ChunkPasses:
    """The per-chunk passes over the (rows, V) logits. Eager torch makes several passes per chunk
    (upcast copy, max, sum, write); on a GPU those passes, not the matmuls, were most of the
    head's time (on an H200 at SmolLM's head, the forwards of 16 microbatches took 63 ms of
    kernels, 12 of them matmuls). On CUDA they are therefore compiled (inductor: one reduction
    kernel reading the 16-bit logits, one elementwise kernel writing the gradient) whatever
    ``--compile`` says for the blocks, as a library kernel's Triton code would be; a compile
    failure falls back to the eager passes with one warning."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self.planned_compiled = compiled  # what the chunks are sized for, whatever happens later
        self.stats = self._guarded(torch.compile(_chunk_stats, dynamic=False), _chunk_stats) if compiled else _chunk_stats
        self.grad = self._guarded(torch.compile(_chunk_grad, dynamic=False), _chunk_grad) if compiled else _chunk_grad

    def logit_bytes(self, dtype: torch.dtype) -> int:
        """Bytes per (row, vocabulary) entry a chunk holds on this path, which sizes the default
        chunk: compiled, the logits and their gradient in the matmul ``dtype`` only (one reduction
        kernel, one elementwise kernel; measured on CPU: 4 in bf16); eagerly ``EAGER_LOGIT_BYTES``.
        Taken from the path planned at construction, so that a compile failure midway does not
        change the chunking, and with it the order of the gradient sums, within a run (the eager
        fallback then holds up to three times the budget)."""
        if self.planned_compiled:
            return 2 * dtype.itemsize
        return EAGER_LOGIT_BYTES

    def _guarded(self, fast, eager):
        def call(*args):
            if self.compiled:
                try:
                    return fast(*args)
                except Exception as exc:  # inductor/Triton unavailable or broken here
                    from .compile import _describe

                    warnings.warn(f"asyncpp: compiling the fused head loss's chunk passes failed "
                                  f"({_describe(exc)}); they run eagerly (slower on a GPU)", stacklevel=2)
                    self.compiled = False
            return eager(*args)
        return call


@functools.lru_cache(maxsize=None)
def _chunk_passes(device: torch.device) -> _ChunkPasses:
    """The passes for ``device``: compiled on CUDA where torch can compile, eager elsewhere (a
    CPU compile would cost seconds per run start for passes that are not the CPU's bottleneck)."""
    if device.type != "cuda":
        return _ChunkPasses(False)
    from .compile import compile_unavailable_reason

    return _ChunkPasses(compile_unavailable_reason(device) is None)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of ``hidden @ weight.T + bias`` row chunk by row chunk.

    ``compute_dtype`` is the matmul dtype (autocast's, or the inputs'); the inputs are cast per call
    here rather than by the caller, and grad_weight is accumulated in fp32 across chunks, rounded
    once to the weight's dtype. Each chunk makes as few passes over its (rows, V) buffers as eager
    torch allows: on a GPU those passes, not the matmuls, are most of the time.

    When gradients will be wanted (``grads``: grad mode was on at the call and an input needs one)
    the forward forms them from each chunk's logits while they are at hand -- the loss is the end
    of the graph, so d loss / d logits is known up to the scalar the backward brings -- and keeps
    them (``g @ W`` as (N, C) in the matmul dtype, grad_weight and grad_bias in fp32) until the
    backward, which only scales them. A backward that recomputed the logits would cost one
    (N x C x V) matmul more per call, a quarter of the head's matmul work. The numbers are those of
    the recomputing form bit for bit: the same products of the same logits, scaled by the same
    factors in the same order. Without ``grads`` (evaluation) only the loss is computed.

    ``z_loss`` (a coefficient z >= 0) adds z * lse^2 per valid row to what the gradients are of,
    not to the value returned (models/z_loss.py)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows, ignore_index, compute_dtype, grads, z_loss=0.0):
        n = hidden.shape[0]
        need_h, need_w, need_b = (grads and flag for flag in ctx.needs_input_grad[:3])
        valid = targets != ignore_index
        safe = targets.masked_fill(~valid, 0)  # an ignored row gathers column 0, then is masked out
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        h = hidden.to(compute_dtype)  # once, not per chunk: a launch less per chunk, N x C more bytes
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # d loss / d logit_ij = scale * valid_i * (softmax_ij - [j == t_i]), scale = grad / count. The
        # (rows, V) buffer holds softmax - onehot unscaled; scale and mask go on the small sides
        # (g @ W's rows in backward, hidden's rows for grad_weight here), saving a pass over the chunk.
        mask = valid.to(compute_dtype)  # 0/1: exact in any dtype
        g_w = torch.empty((n, weight.shape[1]), dtype=compute_dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        h_masked = h * mask[:, None] if need_w else None  # cast and masked once rather than per chunk
        passes = _chunk_passes(hidden.device)
        for s in range(0, n, chunk_rows):
            e = min(s + chunk_rows, n)
            logits = F.linear(h[s:e], w, b)
            lse[s:e], nll = passes.stats(logits, safe[s:e, None], valid[s:e])
            total += nll
            if not (need_h or need_w or need_b):
                continue
            g = passes.grad(logits, safe[s:e, None], lse[s:e, None], compute_dtype, z_loss)
            del logits  # one (rows, V) buffer alive at a time
            if need_h:
                torch.matmul(g, w, out=g_w[s:e])
            if need_w:
                _accumulate(grad_w, g.t(), h_masked[s:e])
            if need_b:
                grad_b += torch.mv(g.t(), mask[s:e]).float()
            del g
        del h, h_masked
        count = valid.sum()
        ctx.save_for_backward(valid, count, g_w, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / count  # 0/0 = nan with every target ignored, like F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss):
        valid, count, g_w, grad_w, grad_b = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        # every target ignored: the loss is 0/0 = nan but the gradient zero, as F.cross_entropy's
        scale = torch.where(count > 0, grad_loss.to(torch.float32) / count.clamp(min=1), 0.0)
        grad_h = None
        if g_w is not None:
            grad_h = torch.empty(g_w.shape, dtype=hidden_dtype, device=g_w.device)
            torch.mul(g_w, (valid.to(torch.float32) * scale)[:, None], out=grad_h)
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(weight_dtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(scale).to(bias_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _flatten(hidden, weight, targets, bias):
    """(N, C) hidden, (N,) targets; raises ValueError on mismatched shapes, dtypes or devices."""
    named = {"hidden": hidden, "weight": weight, "targets": targets, "bias": bias}
    for name, tensor in named.items():
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    for name in ("hidden", "weight", "bias"):
        if named[name] is not None and not named[name].is_floating_point():
            raise ValueError(f"{name} is {named[name].dtype}; it must be a floating-point tensor")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets are {targets.dtype}; they must be class ids (int64)")
    devices = {name: t.device for name, t in named.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"the tensors are on different devices ({', '.join(f'{n} {d}' for n, d in devices.items())}); "
                         "move them to one")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., {hidden.shape[-1]}) does not fit weight {tuple(weight.shape)} (V, C)")
    h2, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if t.shape[0] != h2.shape[0]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    return h2, t


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         bias: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None,
                         ignore_index: int = -100, z_loss: float = 0.0) -> torch.Tensor:
    """Mean cross entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, chunked over rows
    (the portable kernel; any device). hidden (N, C) or (B, T, C); weight (V, C); targets int64.

    Under autocast the matmuls run in autocast's dtype and the softmax in fp32, as the plain path's
    nn.Linear + F.cross_entropy do; gradients come back in the inputs' dtypes. ``z_loss`` (>= 0)
    adds the z-loss to the gradients, not to the value (models/z_loss.py)."""
    z_loss = check_z_loss(z_loss)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an integer (a target id no row is scored on), got {ignore_index!r}")
    h2, t = _flatten(hidden, weight, targets, bias)
    dtype = _autocast_dtype(h2.device)
    if dtype is None:
        if h2.dtype != weight.dtype:  # what F.linear would refuse, said here
            raise ValueError(f"hidden is {h2.dtype} but weight is {weight.dtype}; use autocast or one dtype")
        dtype = weight.dtype
    if chunk_rows is None:
        rows = default_chunk_rows(weight.shape[0], _chunk_passes(h2.device).logit_bytes(dtype))
    elif isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    else:
        rows = chunk_rows
    with _no_autocast(h2.device):
        return _ChunkedLinearCrossEntropy.apply(h2, weight, bias, t, rows, ignore_index, dtype,
                                                torch.is_grad_enabled(), z_loss)


@functools.lru_cache(maxsize=None)
def _library(kernel: str):
    """The library function for ``kernel``, or None when its package is missing or fails to load."""
    module, name = {"liger": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"),
                    "cce": ("cut_cross_entropy", "linear_cross_entropy")}[kernel]
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # ImportError, or triton failing to initialise: the kernel is unavailable
        return None


_HALF = (torch.bfloat16, torch.float16)


def fused_kernel_name(device, dtype: Optional[torch.dtype] = None, bias: bool = False) -> str:
    """The kernel "fused" mode runs on ``device`` for matmuls in ``dtype`` (None: not known yet,
    taken as autocast's 16-bit): "liger" or else "cce" on CUDA where installed, else "chunked".
    cut-cross-entropy is passed over for fp32 and for a bias (its released version has none)."""
    if torch.device(device).type == "cuda":
        if _library("liger") is not None:
            return "liger"
        if _library("cce") is not None and (dtype is None or dtype in _HALF) and not bias:
            return "cce"
    return "chunked"


def require_kernel(kernel: str, device, dtype: Optional[torch.dtype] = None, bias: bool = False,
                   z_loss: float = 0.0) -> str:
    """``kernel`` ("auto" or one of KERNELS) checked against ``device``, the matmul ``dtype``, the
    installed extras and a ``z_loss`` (which only the chunked kernel forms: "auto" means it then);
    returns the kernel that will run, or raises ValueError (one line) when an explicitly named
    kernel cannot run here."""
    if kernel == "auto":
        return "chunked" if z_loss else fused_kernel_name(device, dtype, bias)
    if kernel not in KERNELS:
        raise ValueError(f"unknown head-loss kernel {kernel!r}; choose auto, {', '.join(KERNELS)}")
    check_kernel_z_loss(kernel, z_loss)
    if kernel != "chunked":
        if torch.device(device).type != "cuda":
            raise ValueError(f"head-loss kernel {kernel!r} runs on CUDA only; use 'chunked' on {device}")
        if _library(kernel) is None:
            raise ValueError(f"head-loss kernel {kernel!r} is not installed: {_INSTALL[kernel]}")
        if kernel == "cce" and (bias or (dtype is not None and dtype not in _HALF)):
            raise ValueError("head-loss kernel 'cce' takes bf16/fp16 matmuls without a bias; use 'liger' or 'chunked'")
    return kernel


UNCAPTURABLE_KERNELS = ("liger", "cce")
"""The library kernels a CUDA graph cannot capture: Liger-Kernel's forward reads a count with
``.item()``; cut-cross-entropy's is not checked for capture. The chunked kernel reads nothing back."""


def kernel_for_graphs(kernel: str, cuda_graphs: bool) -> str:
    """The fused head's ``kernel`` setting where ``cuda_graphs`` may capture it: "auto" means the
    package's chunked kernel under graphs, and naming one of ``UNCAPTURABLE_KERNELS`` is refused
    (ValueError, one line)."""
    if not cuda_graphs or kernel not in ("auto", *UNCAPTURABLE_KERNELS):
        return kernel
    if kernel == "auto":  # auto's choice where graphs capture: the one kernel they can
        return "chunked"
    raise ValueError(f"head-loss kernel {kernel!r} cannot be captured in a CUDA graph (liger reads a value "
                     "back to the host in its forward; cce is not checked for capture): use the fused "
                     "head's own kernel (--head-loss chunked) or drop --cuda-graphs")


def fused_linear_cross_entropy(hidden, weight, targets, *, bias=None, kernel: str = "auto",
                               chunk_rows: Optional[int] = None, z_loss: float = 0.0) -> torch.Tensor:
    """Mean cross entropy of ``hidden @ weight.T (+ bias)`` by ``kernel`` (``require_kernel``);
    ``chunk_rows`` applies to the chunked kernel only, and a ``z_loss`` runs there."""
    dtype = _autocast_dtype(hidden.device) or weight.dtype  # what the matmul runs in
    name = require_kernel(kernel, hidden.device, dtype, bias is not None, z_loss)
    if name == "chunked":
        return linear_cross_entropy(hidden, weight, targets, bias=bias, chunk_rows=chunk_rows, z_loss=z_loss)
    h2, t = _flatten(hidden, weight, targets, bias)
    if name == "liger":
        # Liger computes under the caller's autocast (bf16 matmul of the fp32 weight, fp32 softmax,
        # fp32 grad_weight accumulator), so the tensors go in as they are. It forms the gradients
        # already in forward and keeps them (V x C, N x C) until backward instead of the inputs.
        return _library("liger")(h2, weight, t.contiguous(), bias=bias, reduction="mean")
    # cut-cross-entropy wants one 16-bit dtype for both operands: cast as autocast would (the
    # casts are autograd ops, so gradients return in the inputs' dtypes); filter_eps=None keeps
    # every gradient entry (its default drops those under the dtype's resolution).
    return _library("cce")(h2.to(dtype), weight.to(dtype), t, filter_eps=None, reduction="mean")


def resolve_head_loss(mode: str, vocab_size: int, device=None) -> str:
    """"plain" or "fused" for a run: ``mode`` "plain"/"fused" as given; "auto" fuses when
    ``vocab_size >= FUSED_VOCAB_THRESHOLD``, on any device (the chunked kernel runs everywhere)."""
    if mode not in HEAD_LOSS_MODES:
        raise ValueError(f"head loss must be one of {', '.join(HEAD_LOSS_MODES)}, got {mode!r}")
    if mode == "auto":
        return "fused" if vocab_size >= FUSED_VOCAB_THRESHOLD else "plain"
    return mode


def head_loss(head, x: torch.Tensor, targets: torch.Tensor, mode: str = "plain", *,
              kernel: str = "auto", chunk_rows: Optional[int] = None, z_loss: float = 0.0) -> torch.Tensor:
    """The last block's mean cross entropy. "plain": ``BlockModel.loss(head(x), targets)``, the
    historical path, bit for bit. "fused": ``head.features(x)`` into the fused kernel with the
    head's ``output_weight``/``output_bias`` read now (a re-pointed or tied Parameter is used).
    ``z_loss``: the z-loss's gradient on either path (models/z_loss.py)."""
    if mode == "plain":
        return plain_loss(BlockModel.loss, head(x), targets, z_loss)
    if mode != "fused":
        raise ValueError(f"head_loss mode must be 'plain' or 'fused' (resolve 'auto' first), got {mode!r}")
    return fused_linear_cross_entropy(head.features(x), head.output_weight, targets,
                                      bias=head.output_bias, kernel=kernel, chunk_rows=chunk_rows, z_loss=z_loss)


def _cpu_peak_bytes(prof) -> int:
    """Peak of the bytes torch's CPU allocator held above the start, from the profiler's
    allocation (+) and free (-) events in time order (tracemalloc does not see torch's allocations,
    and RSS would count the allocator's caching and every other thread's memory)."""
    cpu = torch._C._autograd.DeviceType.CPU
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_head_loss(mode: str, batch: int, seq: int, n_embd: int, vocab: int, device="cpu",
                      dtype=torch.float32, *, kernel: str = "auto", chunk_rows: Optional[int] = None,
                      seed: int = 0, repeats: Optional[int] = None) -> dict:
    """One forward + backward of a Llama head (RMSNorm + untied projection, fp32 weights) and its loss
    on a (batch, seq, n_embd) activation, as the last pipeline stage runs it: ``dtype`` float32, or
    bfloat16 = autocast with fp32 weights. Returns seconds (wall, synchronised; on CUDA the median
    of ``repeats`` calls after a warm-up, default 5: one call of a few milliseconds is at the mercy
    of the host; on CPU one call), peak_bytes (bytes allocated above the inputs at the peak: CUDA's
    allocator statistics, or on CPU the profiler's allocation events) and loss (a float). ``mode``
    "plain" | "fused" (``head_loss``)."""
    from .llama import LlamaConfig, LlamaHead

    device = torch.device(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype, dtype)
    gen = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, seq_len=seq, n_layer=1, n_embd=n_embd, n_head=1, n_kv_head=1,
                      intermediate_size=n_embd, tie_embeddings=False)
    head = LlamaHead(cfg)
    with torch.no_grad():
        head.proj.weight.copy_(torch.randn(vocab, n_embd, generator=gen) * 0.02)
    head.to(device)
    x = torch.randn(batch, seq, n_embd, generator=gen).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            loss = head_loss(head, x, targets, mode, kernel=kernel, chunk_rows=chunk_rows)
        loss.backward()
        return loss.detach()

    if repeats is not None and repeats < 1:
        raise ValueError(f"repeats must be a positive number of timed calls, got {repeats!r}")
    if device.type == "cuda":
        step()  # warm-up: library kernels compile (Triton) on their first call
        times = []
        for _ in range(5 if repeats is None else repeats):
            x.grad = head.proj.weight.grad = head.norm.weight.grad = None  # each call forms its own
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            loss = step()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            start = time.perf_counter()
            loss = step()
            seconds = time.perf_counter() - start
        peak = _cpu_peak_bytes(prof)
    return {"seconds": seconds, "peak_bytes": int(peak), "loss": float(loss)}


__all__ = ["HEAD_LOSS_MODES", "KERNELS", "FUSED_VOCAB_THRESHOLD", "CHUNK_BYTES", "EAGER_LOGIT_BYTES",
           "default_chunk_rows", "linear_cross_entropy", "fused_linear_cross_entropy", "fused_kernel_name",
           "require_kernel", "kernel_for_graphs", "resolve_head_loss",
           "head_loss", "measure_head_loss", "addmm_writes_fp32"]
