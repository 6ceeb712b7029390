"""How a run's blocks compute on its device (``StageCompute``), resolved once from its config by
``stage_compute``: compiled or not, the head's loss and its kernel, the attention kernel, CUDA
graphs, compute copies, the z-loss and the document mask -- each refused in one line, naming its
flag, where it cannot run here -- and the whole model's loss function they make (``model_loss``).
The simulator, every pipeline rank, asyncpp-eval and the dry run resolve through here, so that a
pipeline and its --simulate run always compute alike."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..data import DataError
from ..data.sources import boundary_of
from ..models.attention import resolve_attention
from ..models.base import forward_through
from ..models.compile import resolve_compile
from ..models.document_mask import within_documents
from ..models.head_loss import (KERNELS, UNCAPTURABLE_KERNELS, head_loss, kernel_for_graphs, require_kernel,
                                resolve_head_loss)
from ..models.z_loss import plain_loss
from .config import RunConfig
from .simulate import default_loss, model_logits


@dataclass(frozen=True)
class StageCompute:
    """How blocks compute on the run's device: compiled or not, and the last block's loss."""
    compile: bool
    head_loss: str
    """"plain" or "fused"."""
    kernel: str = "auto"
    """The fused head loss's kernel: "auto" (models/head_loss.fused_kernel_name), "liger", "cce",
    "chunked"."""
    cuda_graphs: bool = False
    """Replay each microbatch's forward and backward from CUDA graphs (models/graphs.py)."""
    compute_copies: bool = False
    """Under bf16, run the linear layers on bf16 weight copies made once per weight version
    (pipeline/compute_copies.py)."""
    compile_scope: str = "block"
    """With ``compile``: each block alone, or a stage's blocks but the head as one region
    (models/regions.py)."""
    compile_mode: str = "default"
    """With ``compile``: inductor's mode, "default" or "max-autotune" (models/compile.py)."""
    inductor_options: tuple = ()
    """With ``compile``: inductor config options on top of the mode's, as sorted (name, value) pairs."""
    attention: str = "default"
    """The attention kernel: "cudnn" (first), "flash" (cuDNN's off), or "default" (torch's own
    choice) (models/attention.py)."""
    gradient_accumulation_fusion: bool = False
    """The compute copies' weight gradients added into float32 by their products
    (pipeline/main_grad.py)."""
    z_loss: float = 0.0
    """The z-loss's coefficient (--z-loss; models/z_loss.py): in the gradient of the
    last block's loss on either head path; the fused head then runs its chunked kernel."""
    document_boundary: Optional[int] = None
    """--document-mask's boundary token id: attention within documents (models/document_mask.py);
    None = the whole window."""


_UNSET = {"--compile-scope": "block", "--compile-mode": "default", "--inductor-option": "none"}
"""The value of each compile-only flag that leaves its setting at the default."""


@contextlib.contextmanager
def _refusals_name(flag: str):
    """A ValueError raised inside, its message prefixed with ``flag`` unless it names its flag already
    (the library's resolvers speak of kernels and devices; the CLI's user typed a flag)."""
    try:
        yield
    except ValueError as exc:
        if not str(exc).startswith("--"):  # the same exception (type, traceback), its message prefixed
            exc.args = (f"{flag}: {exc}",) + exc.args[1:]
        raise


def stage_compute(cfg: RunConfig, device=None) -> StageCompute:
    """--compile, --head-loss and --attention resolved for ``device`` (default: the run's).
    ValueError (one line, starting with the flag it is about) where an explicit request cannot run
    here: --compile without a working torch.compile, a head-loss kernel off CUDA or without its
    extra, a CUDA attention kernel off CUDA."""
    device = torch.device(device or cfg.train.device)
    mode = cfg.train.head_loss
    kernel = mode if mode in KERNELS else "auto"  # --head-loss liger|cce|chunked: fused by that kernel
    z_loss = cfg.optim.z_loss
    with _refusals_name("--head-loss"):
        if kernel != "auto":
            require_kernel(kernel, device, z_loss=z_loss)
            mode = "fused"
        graphs = resolve_cuda_graphs(cfg, device)
        kernel = kernel_for_graphs(kernel, graphs)  # "auto": the chunked kernel under graphs
        if z_loss and kernel == "auto":  # the one kernel that forms the z-loss's gradient
            kernel = "chunked"
        head = resolve_head_loss(mode, cfg.model.vocab_size, device)
    with _refusals_name("--compile"):
        compile_ = resolve_compile(cfg.train.compile, device)
    scope, compile_mode = cfg.train.compile_scope, cfg.train.compile_mode
    options = tuple(sorted(cfg.train.inductor_options.items()))
    if (scope != "block" or compile_mode != "default" or options) and not compile_:
        why = "--no-compile" if cfg.train.compile is False else f"compiling is off by default on {device.type}"
        flag, value = (("--compile-scope", scope) if scope != "block" else
                       ("--compile-mode", compile_mode) if compile_mode != "default" else
                       ("--inductor-option", " ".join(f"{k}={v!r}" for k, v in options)))
        if cfg.train.resume and cfg.train.compile is None:  # the checkpoint's, its run compiled by default
            drop = f"pass {flag} {_UNSET[flag]} (the resumed run's setting; its device compiled by default)"
        else:
            drop = f"drop {flag}" if flag != "--inductor-option" else "pass --inductor-option none"
        raise ValueError(f"{flag} {value} says how blocks are compiled, but {why}; add --compile or {drop}")
    with _refusals_name("--attention"):
        attention = resolve_attention(cfg.train.attention, device)
    if attention == "flex":
        check_flex_attention(cfg, compile_)
    fusion = cfg.train.gradient_accumulation_fusion
    if fusion:
        check_gradient_accumulation_fusion(cfg, device)
    with _refusals_name("--document-mask"):
        boundary = document_boundary(cfg)
    return StageCompute(compile_, head, kernel, cuda_graphs=graphs, compute_copies=cfg.train.compute_copies,
                        compile_scope=scope, compile_mode=compile_mode, inductor_options=options,
                        attention=attention, gradient_accumulation_fusion=fusion, z_loss=z_loss,
                        document_boundary=boundary)


def check_flex_attention(cfg: RunConfig, compiled: bool) -> None:
    """ValueError (one line) where ``--attention flex`` (models/attention.py) cannot do its job:
    without --document-mask (nothing to skip: cudnn or flash is the faster causal kernel), in eager
    blocks (flex_attention uncompiled is an unfused reference, a silent slowdown), or for a Hugging
    Face model (its layers take a tensor mask)."""
    if cfg.train.document_mask is None:
        raise ValueError("--attention flex runs the document mask's attention block-sparse; add --document-mask, "
                         "or use --attention auto for plain causal attention")
    if not compiled:
        why = "--no-compile" if cfg.train.compile is False else "compiling is off"
        raise ValueError(f"--attention flex runs fused only in compiled blocks, but {why}; add --compile "
                         "or use --attention auto")
    if cfg.model.arch == "hf":
        raise ValueError("--attention flex runs the package's own models' attention, not a Hugging Face "
                         "model's layers; use --attention auto")


def document_boundary(cfg: RunConfig) -> Optional[int]:
    """--document-mask's token id: as given, or for "data" the boundary token the training data's
    sidecars record (every --data-mix source's the same); None when off. ValueError (one line)
    where the data records none, or its sources record different ones."""
    mask = cfg.train.document_mask
    if mask != "data":
        return mask
    d = cfg.data
    sources = [d.source] if not d.mix else [path for path, _ in d.mix]
    try:
        found = {source: boundary_of(source, "--data-mix" if d.mix else "--data") for source in sources}
    except DataError as exc:
        raise ValueError(f"the data's boundary token cannot be read: {exc}") from None
    missing = [source for source, b in found.items() if b is None]
    if missing:
        raise ValueError(f"{missing[0]} records no document boundary token (text, the built-in corpus, a .bin "
                         "without asyncpp-prepare-data's sidecar, or prepared with --doc-boundary none); pass "
                         "the id of the token that marks its documents (e.g. --document-mask 50256 for GPT-2's "
                         "<|endoftext|>), or prepare it with --doc-boundary eos")
    ids = {b[0] for b in found.values()}
    if len(ids) > 1:
        raise ValueError(f"the --data-mix sources mark documents by different tokens "
                         f"({', '.join(f'{s}: {b[1]} = {b[0]}' for s, b in found.items())}); prepare them alike "
                         "or name one id")
    return ids.pop()


def check_gradient_accumulation_fusion(cfg: RunConfig, device) -> None:
    """ValueError (one line) where --gradient-accumulation-fusion cannot run: no bf16 compute
    copies (a float32 run), or no cuBLAS to call on CUDA."""
    from ..pipeline.main_grad import fusion_available
    from ..pipeline.recompute import resolve_autocast

    if resolve_autocast(cfg.train.dtype, device) != torch.bfloat16:
        raise ValueError(f"--gradient-accumulation-fusion adds the bf16 compute copies' weight gradients, but "
                         f"--dtype {cfg.train.dtype} computes in float32 on {device.type}; use --dtype bf16 "
                         "or drop --gradient-accumulation-fusion")
    why = fusion_available(device)
    if why is not None:
        raise ValueError(f"--gradient-accumulation-fusion: {why}")


def resolve_cuda_graphs(cfg: RunConfig, device) -> bool:
    """--cuda-graphs as given, or, left at auto (None), on for the one-process --schedule sync run
    on CUDA -- the step measured faster with them (2.17x at smollm-135m on an H100, docs/results.md)
    -- unless --recompute or an explicit liger/cce head kernel cannot run under them. Pipelines
    and their simulations take it only when asked, so a pipeline and its --simulate run always
    choose alike (a --simulate run of gpipe or 1f1b is one process too, but not --schedule sync)."""
    t = cfg.train
    if t.cuda_graphs is not None:
        return t.cuda_graphs
    return (torch.device(device).type == "cuda" and cfg.pipeline.schedule == "sync" and not cfg.pipeline.recompute
            and t.head_loss not in UNCAPTURABLE_KERNELS and t.document_mask is None)


def model_loss(compute: StageCompute):
    """``(model, inputs, targets) -> loss`` of a whole model with blocks(): the blocks in order and
    the last one's loss by ``compute.head_loss`` (the plain path is default_loss, bit for bit)."""
    z_loss, boundary = compute.z_loss, compute.document_boundary
    if compute.head_loss == "plain":
        if not z_loss:
            inner = default_loss
        else:
            def inner(model, inputs, targets):
                return plain_loss(model.loss, model_logits(model, inputs), targets, z_loss)
    else:
        def inner(model, inputs, targets):
            *body, head = model.blocks()
            return head_loss(head, forward_through(body, inputs), targets, "fused", kernel=compute.kernel,
                             z_loss=z_loss)
    if boundary is None:
        return inner

    def within(model, inputs, targets):  # the blocks attend within the inputs' documents
        with within_documents(inputs, boundary):
            return inner(model, inputs, targets)
    return within


__all__ = ["StageCompute", "stage_compute", "document_boundary", "check_flex_attention", "check_gradient_accumulation_fusion",
           "resolve_cuda_graphs", "model_loss"]
