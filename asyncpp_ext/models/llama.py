"""A Llama-architecture decoder expressed as a list of blocks, so a pipeline partitioner can split it.

Layout (pre-norm, RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases)::

    blocks[0]      LlamaEmbedding  int64 (B, T)  -> float (B, T, C)   token embedding only
    blocks[1..L]   LlamaBlock      (B, T, C)     -> (B, T, C)         x + attn(norm(x)); x + mlp(norm(x))
    blocks[L+1]    LlamaHead       (B, T, C)     -> (B, T, V)         final RMSNorm + linear head

Positions enter only through the rotary embedding, which every ``LlamaBlock`` applies from tables
it holds (non-persistent buffers up to ``seq_len``), sliced to the length of its input: nothing but
the hidden state crosses a block boundary, so blocks can run on different pipeline stages. The numerics follow ``transformers.LlamaForCausalLM`` (rotary
"rotate half" layout, RMSNorm in float32), so weights mapped by name give the same logits.

With ``tie_embeddings`` the head's projection *is* the embedding table (one ``nn.Parameter``).
The head reads ``head.proj.weight`` at call time, so a pipeline stage that holds the head apart
from the embedding may replace it with its own Parameter holding the same values.

Parameter names are global and stable: ``embed.tok.weight``, ``layers.3.attn_norm.weight``,
``layers.3.attn.q_proj.weight``, ``layers.3.mlp_norm.weight``, ``layers.3.mlp.gate_proj.weight``,
``head.norm.weight``, ``head.proj.weight``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from .base import (BlockModel, ProjectionHead, check_init_std, check_token_ids, extend_cache, init_normal_,
                   skip_default_init)
from .document_mask import active_mask, attend_within

NATIVE_GQA_DEVICES = ("cuda",) if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5) else ()
"""Devices where attention hands grouped-query key/value heads to SDPA as they are
(``enable_gqa=True``, torch >= 2.5; its flash and cuDNN kernels read each shared head in place)
instead of repeating them per query head first: on a GPU the repeat wrote, and its backward summed,
a copy of k and v ``n_head / n_kv_head`` times their size in every layer and microbatch. The CPU
keeps the repeat (its numbers stay those of earlier runs)."""


class LlamaConfigError(ValueError):
    """A Llama shape or preset that cannot build a model; the message names the field."""


class LlamaInputError(ValueError):
    """Token ids a Llama model cannot take (wrong rank, longer than ``seq_len``, outside the
    vocabulary)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama model. Every field is part of a checkpoint's identity."""

    vocab_size: int
    """Number of token ids (rows of the embedding table, columns of the logits)."""
    seq_len: int
    """Longest context the model accepts (``max_position_embeddings`` in Hugging Face configs)."""
    n_layer: int
    """Number of transformer blocks (the model has n_layer + 2 pipeline blocks)."""
    n_embd: int
    """Residual stream width C (``hidden_size``)."""
    n_head: int
    """Query heads; must divide n_embd, and n_embd // n_head (the head dim) must be even."""
    n_kv_head: int
    """Key/value heads for grouped-query attention; must divide n_head (n_head = plain attention)."""
    intermediate_size: int
    """Hidden width of the SwiGLU MLP (gate and up projections)."""
    tie_embeddings: bool
    """Use the embedding table as the output projection (one shared Parameter)."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square in every RMSNorm."""
    init_std: float = 0.02
    """Standard deviation of the normal init of embeddings and linear weights."""

    def validate(self) -> None:
        """Raise LlamaConfigError (a ValueError) naming the first field that cannot build a model."""
        for name in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head", "n_kv_head",
                     "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LlamaConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise LlamaConfigError(f"model.n_head={self.n_head} must divide model.n_embd={self.n_embd}; "
                                   "pick a width that is a multiple of the head count")
        if (self.n_embd // self.n_head) % 2:
            raise LlamaConfigError(f"model.n_embd // model.n_head = {self.n_embd // self.n_head} must be "
                                   "even (rotary embeddings rotate pairs of dims); change model.n_head")
        if self.n_head % self.n_kv_head:
            raise LlamaConfigError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head="
                                   f"{self.n_head}; each key/value head serves a whole group of queries")
        if not isinstance(self.tie_embeddings, bool):
            raise LlamaConfigError(f"model.tie_embeddings must be True or False, got {self.tie_embeddings!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise LlamaConfigError(f"model.{name} must be a finite positive number, got {value!r}")
        check_init_std(self.init_std, LlamaConfigError)

    @property
    def head_dim(self) -> int:
        """Width of one attention head, n_embd // n_head."""
        return self.n_embd // self.n_head

    @property
    def num_blocks(self) -> int:
        """How many pipeline blocks ``Llama.blocks()`` returns (embedding + layers + head)."""
        return self.n_layer + 2

    def to_dict(self) -> dict:
        """The fields as a plain dict (for checkpoints and logs)."""
        return asdict(self)


LLAMA_PRESETS = {
    # Tests: seconds on a laptop CPU, with grouped-query attention (2 query heads per kv head).
    "llama-tiny": LlamaConfig(vocab_size=256, seq_len=32, n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                              intermediate_size=64, tie_embeddings=True),
    # The published SmolLM shapes. Checked field by field (hidden_size, num_hidden_layers,
    # num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
    # max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings, initializer_range)
    # against the config.json files on the Hugging Face hub:
    #   huggingface.co/HuggingFaceTB/SmolLM-135M/blob/08113aee5325d8b522b49ed5fbad3f24cc27eeb2/config.json
    #   huggingface.co/HuggingFaceTB/SmolLM-360M/blob/refs%2Fpr%2F4/config.json (the same shape as
    #   SmolLM-360M-Instruct/blob/main/config.json, whose _name_or_path is SmolLM-360M).
    # SmolLM2 differs (max_position_embeddings 8192, rope_theta 100000): not these presets.
    # Parameters, tied embedding counted once: 134,515,008 and 361,821,120.
    "smollm-135m": LlamaConfig(vocab_size=49152, seq_len=2048, n_layer=30, n_embd=576, n_head=9,
                               n_kv_head=3, intermediate_size=1536, tie_embeddings=True,
                               rope_theta=10000.0, norm_eps=1e-5, init_std=0.02),
    "smollm-360m": LlamaConfig(vocab_size=49152, seq_len=2048, n_layer=32, n_embd=960, n_head=15,
                               n_kv_head=5, intermediate_size=2560, tie_embeddings=True,
                               rope_theta=10000.0, norm_eps=1e-5, init_std=0.02),
}


def llama_preset_config(name: str, **overrides) -> LlamaConfig:
    """The preset ``name`` with any non-None ``overrides`` (n_layer, seq_len, tie_embeddings...)."""
    if name not in LLAMA_PRESETS:
        raise LlamaConfigError(f"unknown model preset {name!r}; choose one of {', '.join(LLAMA_PRESETS)}")
    known = {f.name for f in fields(LlamaConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise LlamaConfigError(f"unknown model field(s) {sorted(unknown)}; known: {sorted(known)}")
    cfg = replace(LLAMA_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    cfg.validate()
    return cfg


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32.

    Normalising in float32 and casting back before the weight keeps bf16/fp16 activations from
    losing the small mean square; it is also the order the reference Llama code uses.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device,
                   dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (seq_len, head_dim) for positions 0..seq_len-1.

    Frequency i (of head_dim/2) is theta^(-2i/head_dim); the table repeats the frequencies for the
    two halves of the head ("rotate half" layout). Computed in float32, then cast to ``dtype``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: the table ``apply_rotary`` takes."""
    first, second = sin.chunk(2, dim=-1)
    return torch.cat((-first, second), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, D) by position: dim j pairs with dim j + D/2 (the "rotate half" layout),
    ``x * cos + cat(-second, first) * sin`` with ``sin_signed = signed_sin(sin)``. The rotated half
    is ``x.roll(D/2)`` times the sign-folded table -- bit for bit the same ((-a) * b and a * (-b)
    are one float) -- instead of a concatenation, which inductor may lower as a buffer of its own
    (on the CPU always: one smollm-360m block's generated kernels moved 13 KB per token more,
    forward and backward, by inductor's estimates), while a roll is an index expression that stays
    fused into the kernel that rotates q and k."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


STACKED_PROJECTIONS = "stacked_projections"
"""Class attribute of a module whose compiled forward stacks some of its linear layers in one
product (``fused_linear``): their attribute names, in stacking order."""

STACKED_WEIGHT = "stacked_weight"
"""Parameter a module with ``STACKED_PROJECTIONS`` may carry: those layers' weights already
stacked, one tensor whose rows are theirs (pipeline/compute_copies.py registers one on a compute
module, a view of the buffer where the copies lie side by side). ``fused_linear`` multiplies by it
instead of concatenating the weights in every call."""


STACKED_PRODUCT = "stacked_product"
"""Module a module with ``STACKED_WEIGHT`` may carry: called as ``product(x, stacked_weight)`` in
place of ``F.linear`` (pipeline/main_grad.py registers one that adds the weight's gradient into the
float32 gradients of the rows' weights itself: ``--gradient-accumulation-fusion``)."""


def fused_linear(x: torch.Tensor, *projections: nn.Linear, stacked: torch.Tensor | None = None,
                 product=None) -> tuple[torch.Tensor, ...]:
    """``tuple(p(x) for p in projections)`` as one matrix product with the weights stacked
    (``stacked``: the stacked weight, where the caller holds one; else concatenated here), by
    ``product(x, weight)`` where given (``STACKED_PRODUCT``), else ``F.linear``.

    Used inside compiled blocks only: there the stacking is free with the bf16 compute copies,
    the default under bf16, which hand in ``stacked`` (``STACKED_WEIGHT``), and otherwise one
    kernel (under plain autocast it fuses into the cast to the compute dtype made of every weight
    anyway; in float32 a copy of the weights: at smollm-360m about 6 MB per layer and microbatch
    for q/k/v, 20 MB for gate/up), and one wide GEMM (and two in backward) replaces a narrow one per
    projection -- fewer kernel launches, which bound a small model's step on a GPU, and better
    tiles. Eagerly the stacking would be one more
    copy per call, so eager blocks keep the plain projections (the results differ only in float
    rounding: the same dot products, possibly summed in another order).

    Attention's q, k and v use it, and SwiGLU's gate and up. The backward of the split is a
    concatenation of the parts' gradients; compiled blocks lower a concatenation as a kernel
    that computes each part straight into its slice (models/compile_support.DEVICE_OPTIONS on
    CUDA, inductor's own lowering on the CPU), so the SwiGLU backward writes the gate and up
    gradients into the halves of one buffer in one pass, and one product (K = 2 x hidden) turns
    them into the norm's input gradient: one bf16 activation less to write and to read back twice
    (the norm's backward and its weight's gradient). By inductor's per-kernel byte estimates for
    one smollm-360m block at 8192 tokens (bench/block_bytes.py: bf16 autocast, compute copies,
    generated on the CPU), forward and backward move 248 KB per token with gate and up stacked
    against 258 with two products (its ``separate-gate-up`` form; generated kernels 136 against
    140, extern kernels -- matrix products, the CPU's attention -- 112 against 118), with 3 GEMMs
    fewer per layer and microbatch. Under inductor's pointwise lowering of a concatenation
    (``max_pointwise_cat_inputs`` > 0, the bench's ``cat-fused`` row) the concatenation's kernel
    cannot fuse with the SwiGLU backward and the stacked form moves more bytes than two products;
    bench/block_step.py's ``separate-gate-up`` form measures two products against it."""
    if any(p.bias is not None for p in projections):  # (the package's models have none)
        raise ValueError("fused_linear stacks bias-free projections only; one of them has a bias")
    if stacked is None:
        weight, product = torch.cat([p.weight for p in projections]), None  # (a product is for stacked)
    else:
        weight = stacked
    return (product or F.linear)(x, weight).split([p.out_features for p in projections], dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions, no biases."""

    stacked_projections = ("q_proj", "k_proj", "v_proj")  # one product when compiled

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``cos`` and ``sin_signed``: the rotary tables (T, D) of ``apply_rotary``."""
        q, k, v = self.project(x)
        return self.attend(apply_rotary(q, cos, sin_signed), apply_rotary(k, cos, sin_signed), v,
                           mask=active_mask())

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v, each (B, heads, T, D): views of the projections' (B, T, heads, D)."""
        b, t, _ = x.shape
        if torch.compiler.is_compiling():  # one product for q, k and v (see fused_linear)
            q, k, v = fused_linear(x, self.q_proj, self.k_proj, self.v_proj,
                                   stacked=getattr(self, STACKED_WEIGHT, None),
                                   product=getattr(self, STACKED_PRODUCT, None))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(b, t, self.n_head, self.head_dim).transpose(1, 2),
                k.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2),
                v.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache: dict) -> torch.Tensor:
        """``forward`` of new positions (``cos``/``sin_signed``: their rows of the rotary tables)
        after those whose rotated keys and values ``cache`` holds (base.extend_cache)."""
        q, k, v = self.project(x)
        k, v, causal = extend_cache(cache, apply_rotary(k, cos, sin_signed), v)
        # sampling within documents: the held mask has the new positions' rows (models/generate.py)
        return self.attend(apply_rotary(q, cos, sin_signed), k, v, causal, mask=active_mask())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the rotated q, k and v (B, heads, T, D) -- causal unless a cache's new
        position reads every key, or by ``mask`` (a boolean (B, 1, T, T), True where allowed, or
        the same as a FlexAttention BlockMask: models/document_mask.py) -- then the output projection."""
        b, _, t, _ = q.shape
        group = self.n_head // self.n_kv_head  # query head h reads key/value head h // group
        native = group > 1 and q.device.type in NATIVE_GQA_DEVICES
        if group > 1 and not native:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        if mask is not None:
            y = attend_within(q, k, v, mask, enable_gqa=native)
        elif native:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases; compiled, gate and up as one stacked product (see
    fused_linear)."""

    stacked_projections = ("gate_proj", "up_proj")

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        return self.down_proj(F.silu(gate) * up)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, C) -> the gate and up projections, each (B, T, hidden)."""
        if torch.compiler.is_compiling():  # one product for both (see fused_linear)
            return fused_linear(x, self.gate_proj, self.up_proj, stacked=getattr(self, STACKED_WEIGHT, None),
                                product=getattr(self, STACKED_PRODUCT, None))
        return self.gate_proj(x), self.up_proj(x)


class LlamaEmbedding(nn.Module):
    """Token ids (B, T) -> token embedding (B, T, C); positions are added later, by rotation."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``start``: the position of ``idx``'s first id (sampling with a key/value cache)."""
        check_token_ids(idx, self.tok.num_embeddings, LlamaInputError)
        if idx.dim() != 2:
            raise LlamaInputError(f"token ids must have shape (batch, time), got {tuple(idx.shape)}")
        t = idx.shape[1]
        if start + t > self.seq_len:
            raise LlamaInputError(f"sequence length {start + t} exceeds the model's seq_len {self.seq_len}; "
                                  "shorten the input or build the model with a larger seq_len")
        return self.tok(idx)


class LlamaBlock(nn.Module):
    """One pre-norm Llama block: (B, T, C) -> (B, T, C). Derives its rotary tables from T."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        # The rotary tables for every position up to seq_len, in float32, made once: computed
        # inside each call, a compiled block fused cos/sin into the kernels that rotate q and k
        # and evaluated them per element of every head and microbatch, forward and backward
        # (~7 % of a SmolLM step's GPU time on an H200). Buffers, not parameters: they move with
        # the block, stay out of the weights, the optimizer and (non-persistent) checkpoints.
        # The sin table is kept sign-folded, as apply_rotary takes it.
        cos, sin = rotary_cos_sin(cfg.seq_len, cfg.head_dim, cfg.rope_theta, "cpu", torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]  # the embedding refused inputs longer than seq_len
        cos, sin_signed = self.rope_cos[:t].to(x.dtype), self.rope_sin_signed[:t].to(x.dtype)
        x = x + self.attn(self.attn_norm(x), cos, sin_signed)
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
        """``forward`` of the positions from ``start`` on, attending to the cached ones before them."""
        t = x.shape[1]
        cos, sin_signed = self.rope_cos[start:start + t].to(x.dtype), self.rope_sin_signed[start:start + t].to(x.dtype)
        x = x + self.attn.forward_cached(self.attn_norm(x), cos, sin_signed, cache)
        return x + self.mlp(self.mlp_norm(x))


class LlamaHead(ProjectionHead):
    """Final RMSNorm + linear projection to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        # nn.Linear reads self.proj.weight at call time, so a replaced (untied) Parameter is used.
        self.proj = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What goes into the projection (the final RMSNorm); head_loss.py's fused loss starts here."""
        return self.norm(x)


class Llama(BlockModel):
    """The Llama model as ``blocks()``: embedding, ``n_layer`` Llama blocks, head."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0):
        super().__init__()
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"Llama takes a LlamaConfig, got {type(cfg).__name__}; build one with "
                            "LlamaConfig(...) or llama_preset_config(name)")
        cfg.validate()
        self.config = cfg
        # reset_parameters writes every parameter from the seed: torch's default module init
        # (draws from the global RNG it would overwrite) is skipped, and the global RNG forked in
        # case a module draws anyway, so building a model never shifts the caller's random stream.
        with torch.random.fork_rng(devices=[]), skip_default_init():
            self.embed = LlamaEmbedding(cfg)
            self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
            self.head = LlamaHead(cfg)
        if cfg.tie_embeddings:
            self.head.proj.weight = self.embed.tok.weight
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed``: ``llama_init_`` of the whole model."""
        llama_init_(self, seed, self.config)


def llama_init_(module: nn.Module, seed: int, cfg: LlamaConfig) -> None:
    """Deterministic init of a Llama model or any part of one (a block) from ``seed``
    (base.init_normal_): Normal(0, init_std) for the embedding and linear weights, the residual
    output projections (o_proj, down_proj) scaled by 1/sqrt(2 * n_layer); RMSNorm weights at 1. A
    tied table is drawn once, as the embedding."""
    init_normal_(module, seed, cfg.init_std, cfg.n_layer,
                 is_one=lambda n: n.endswith("norm.weight"),
                 is_residual_out=lambda n: n.endswith("o_proj.weight") or n.endswith("down_proj.weight"))


__all__ = ["LlamaConfig", "LlamaConfigError", "LlamaInputError", "LLAMA_PRESETS", "llama_preset_config",
           "RMSNorm", "STACKED_PROJECTIONS", "STACKED_WEIGHT", "STACKED_PRODUCT", "fused_linear", "Attention", "SwiGLU", "LlamaEmbedding", "LlamaBlock", "LlamaHead", "Llama",
           "llama_init_"]
