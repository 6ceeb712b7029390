"""A small GPT expressed as a list of blocks, so a pipeline partitioner can split it between stages.

Layout (pre-norm, nanoGPT-like, no dropout, no weight tying)::

    blocks[0]      Embedding     int64 (B, T)   -> float (B, T, C)   token + learned position
    blocks[1..L]   Block         (B, T, C)      -> (B, T, C)         x + attn(ln(x)); x + mlp(ln(x))
    blocks[L+1]    Head          (B, T, C)      -> (B, T, V)         final LayerNorm + linear head

The embedding and the head are separate matrices because they live on different pipeline stages.
``GPT.forward`` runs exactly these blocks in order, so a single process and a pipeline split
execute the very same operations. Parameter names (``embed.tok.weight``, ``layers.3.attn.qkv.bias``,
``head.proj.weight``...) are global: they do not depend on how the model is split.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from .base import (BlockModel, ProjectionHead, check_init_std, check_token_ids, extend_cache, init_normal_,
                   skip_default_init)
from .document_mask import active_mask, attend_within


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT. Every field is part of a checkpoint's identity."""

    vocab_size: int = 256
    """Number of token ids; 256 = raw bytes (the built-in corpus and text files)."""
    seq_len: int = 32
    """Context length T: the longest sequence the position embedding covers."""
    n_layer: int = 2
    """Number of transformer blocks (the model has n_layer + 2 pipeline blocks)."""
    n_embd: int = 32
    """Residual stream width C."""
    n_head: int = 2
    """Attention heads; must divide n_embd."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of n_embd."""
    init_std: float = 0.02
    """Standard deviation of the normal init of embeddings and linear weights."""

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot build a model."""
        for name in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_head={self.n_head} must divide model.n_embd={self.n_embd}; "
                             "pick a width that is a multiple of the head count")
        check_init_std(self.init_std)

    @property
    def num_blocks(self) -> int:
        """How many pipeline blocks ``GPT.blocks()`` returns (embedding + layers + head)."""
        return self.n_layer + 2

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # Tests: seconds on a laptop CPU.
    "tiny": GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=32),
    # Studies: the reference scale of docs/design.md §1.12 (4 layers, width 128, context 64).
    "small": GPTConfig(n_layer=4, n_embd=128, n_head=4, seq_len=64),
}


def preset_config(name: str, **overrides) -> GPTConfig:
    """The preset ``name`` with any non-None ``overrides`` (n_layer, n_embd, n_head, seq_len...)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(GPTConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown model field(s) {sorted(unknown)}; known: {sorted(known)}")
    cfg = replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    cfg.validate()
    return cfg


class Embedding(nn.Module):
    """Token ids (B, T) -> token embedding + learned position embedding (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)

    def forward(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``start``: the position of ``idx``'s first id (sampling with a key/value cache)."""
        check_token_ids(idx, self.tok.num_embeddings)
        if idx.dim() != 2:
            raise ValueError(f"token ids must have shape (batch, time), got {tuple(idx.shape)}")
        t = idx.shape[1]
        if start + t > self.seq_len:
            raise ValueError(f"sequence length {start + t} exceeds the model's seq_len {self.seq_len}; "
                             "shorten the input or build the model with a larger seq_len")
        positions = torch.arange(start, start + t, device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        mask = active_mask()  # None but under --document-mask (models/document_mask.py)
        if mask is None:
            return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.merge(attend_within(q, k, v, mask))

    def forward_cached(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        """``forward`` of new positions after those whose keys and values ``cache`` holds (base.extend_cache)."""
        q, k, v = self.heads(x)
        k, v, causal = extend_cache(cache, k, v)
        mask = active_mask()  # sampling within documents: the new positions' rows (models/generate.py)
        if mask is None:
            return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        return self.merge(attend_within(q, k, v, mask))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v, each (B, heads, T, C/heads)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        return tuple(z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (B, heads, T, C/heads) -> the output projection of (B, T, C)."""
        b, _, t, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward_cached(self, x: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
        """``forward`` of the positions from ``start`` on, attending to the cached ones before them."""
        x = x + self.attn.forward_cached(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class Head(ProjectionHead):
    """Final LayerNorm + linear projection to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What goes into the projection (the final LayerNorm); head_loss.py's fused loss starts here."""
        return self.ln(x)


class GPT(BlockModel):
    """The GPT as ``blocks()``: embedding, ``n_layer`` transformer blocks, head."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT takes a GPTConfig, got {type(cfg).__name__}; build one with "
                            "GPTConfig(...) or preset_config(name)")
        cfg.validate()
        self.config = cfg
        # reset_parameters writes every parameter from the seed: torch's default module init
        # (draws from the global RNG it would overwrite) is skipped, and the global RNG forked in
        # case a module draws anyway, so building a model never shifts the caller's random stream.
        with torch.random.fork_rng(devices=[]), skip_default_init():
            self.embed = Embedding(cfg)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.head = Head(cfg)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed`` (base.init_normal_): Normal(0, init_std) for embeddings
        and linear weights, the residual output projections scaled by 1/sqrt(2 * n_layer) (GPT-2);
        zero biases; LayerNorm at identity."""
        init_normal_(self, seed, self.config.init_std, self.config.n_layer,
                     is_zero=lambda n: n.endswith("bias"),
                     is_one=lambda n: ".ln" in n or n.startswith("head.ln"),
                     is_residual_out=lambda n: n.endswith("attn.proj.weight") or n.endswith("mlp.proj.weight"))


__all__ = ["GPTConfig", "PRESETS", "preset_config", "Embedding", "Block", "Head", "GPT"]
