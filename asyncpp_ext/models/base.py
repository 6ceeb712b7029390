"""What every model of the package shares: it runs as pipeline blocks ``[embed, *layers, head]``
(each block takes one tensor and returns one), its loss is the mean cross entropy, and the
models this package defines initialise from a seed with a private generator."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


REGION_MARK = "_asyncpp_region"
"""Instance attribute on the first block of a compiled region (models/regions.py): an object with
``length`` and ``run(blocks, x)``, which runs that many consecutive blocks as one compiled call."""


def forward_through(blocks, x: torch.Tensor) -> torch.Tensor:
    """Run ``blocks`` in order on ``x``. Where a block starts a compiled region (``REGION_MARK``)
    and the region's blocks follow it here, they run as the region's one compiled call; every other
    block is called as usual."""
    i, n = 0, len(blocks)
    while i < n:
        mark = blocks[i].__dict__.get(REGION_MARK)
        if mark is not None and i + mark.length <= n:
            x = mark.run(blocks[i:i + mark.length], x)
            i += mark.length
        else:
            x = blocks[i](x)
            i += 1
    return x


def row_losses(blocks, x: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """(B,) float32: per row of ``x`` the summed cross entropy, through ``blocks`` (the last one the
    model's head), over the row's targets that are not ``ignore_index``. The head runs one row at
    a time, so at most one row's fp32 logits (T x V) exist at once: an evaluation's figure (the
    multiple-choice scores of --eval-choices), computed the same way in one process and on a
    pipeline's last stage."""
    *body, head = blocks
    hidden = forward_through(body, x)
    sums = [F.cross_entropy(head(hidden[i:i + 1])[0].float(), targets[i], ignore_index=ignore_index, reduction="sum")
            for i in range(hidden.shape[0])]
    return torch.stack(sums)


class BlockSequence(nn.Sequential):
    """A pipeline stage's blocks: an nn.Sequential (same names, same state_dict) whose forward runs
    them through ``forward_through``, so a compiled region among them is one call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward_through(list(self), x)


class BlockModel(nn.Module):
    """A causal LM held as ``embed``, ``layers`` (nn.ModuleList) and ``head``; subclasses build them
    in that order, so parameter names and order follow the blocks."""

    def blocks(self) -> list[nn.Module]:
        """The pipeline blocks in order: [embed, *layers, head]."""
        return [self.embed, *self.layers, self.head]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Run the blocks in order. Returns ``(logits, loss)``; ``loss`` is None without targets."""
        x = forward_through(self.blocks(), idx)
        return x, (None if targets is None else self.loss(x, targets))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over all (batch, time) positions."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_parameters(self) -> int:
        """Distinct parameter elements (a tied tensor counts once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def attention_width(self) -> int:
        """Query heads x head width of the attention layers: the width of the products each query
        makes with the keys and values (models/flops.py counts them). The embedding width here, as
        in the package's GPT and Llama; a family whose heads are sized otherwise says so."""
        return next(m for m in self.embed.modules() if isinstance(m, nn.Embedding)).embedding_dim


class ProjectionHead(nn.Module):
    """A head that is a final norm then ``self.proj`` (an nn.Linear to the vocabulary): subclasses
    set ``proj`` and define ``features`` (the norm), which head_loss.py's fused loss starts from."""

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def output_weight(self) -> torch.Tensor:
        """The (V, C) projection weight -- the embedding table when tied -- read at call time, so a
        replaced or re-pointed Parameter is the one used."""
        return self.proj.weight

    @property
    def output_bias(self):
        """The projection's bias (None where it has none)."""
        return self.proj.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.features(x))


class _SkipDefaultInit(torch.overrides.TorchFunctionMode):
    """torch.nn.init's functions return their tensor as it is (torch.nn's modules call them from
    their constructors); every other torch function runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def skip_default_init():
    """A context in which torch.nn's modules skip their default init (nn.Linear's kaiming draws,
    nn.Embedding's normal draws: their parameters stay as allocated), for a model whose own init
    then writes every parameter (``init_normal_``): the same values, without the draws it would
    overwrite -- most of a model's build time on the CPU, once per process or rank."""
    return _SkipDefaultInit()


MAX_SEED = 2**63 - 1  # what torch's and numpy's generators both take


def check_seed(seed) -> int:
    """``seed`` if it is an integer in 0..MAX_SEED, else ValueError naming it (torch's generator
    answers a larger one with "Overflow when unpacking long")."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in 0..2**63-1, got {seed!r}")
    return seed


def extend_cache(cache: dict, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Sampling's key/value cache of one attention layer (models/generate.py): ``k`` and ``v`` (B,
    heads, T, D) of the new positions appended to those ``cache`` holds, which then holds them all;
    returns (keys, values, whether the new queries need the causal mask). The first call fills an
    empty cache with a whole prompt (causal); later ones add one position, which attends to every
    key (no mask)."""
    if "k" in cache:
        if k.shape[2] != 1:
            raise ValueError(f"a filled key/value cache takes one new position at a time, got {k.shape[2]}")
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
    causal = "k" not in cache
    cache["k"], cache["v"] = k, v
    return k, v, causal


TOKEN_ID_DTYPES = (torch.int64, torch.int32)
"""The index dtypes ``nn.Embedding`` takes."""


def check_token_ids(idx, vocab_size: int, error: type = ValueError) -> None:
    """Refuse what an embedding block cannot look up, with one line naming it: ``idx`` that is not
    a tensor or not of an integer index dtype (TypeError), or ids outside ``0..vocab_size-1``
    (``error``, a ValueError), which torch answers with a bare "index out of range" on the CPU and
    with a device-side assert, ending the process's CUDA context, on a GPU.

    The range is checked only for ids on the CPU, outside compiled code: there min and max are one
    cheap pass over the ids and reading them back waits for nothing. On an accelerator reading them
    back would make the host wait for the device in every forward of the training loop, and a
    compiled block cannot branch on tensor values (its graph would break), so there the range is
    left to the data: the package's loaders check token files against the vocabulary."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"token ids must be a torch.Tensor of int64 ids (batch, time), got "
                        f"{type(idx).__name__}; convert with torch.as_tensor(ids, dtype=torch.long)")
    if idx.dtype not in TOKEN_ID_DTYPES:
        raise TypeError(f"token ids must be an int64 (or int32) tensor, got dtype {idx.dtype}; "
                        "convert with idx.long()")
    if torch.compiler.is_compiling() or idx.device.type != "cpu" or idx.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(idx))
    if low < 0 or high >= vocab_size:
        raise error(f"token ids must lie in 0..{vocab_size - 1} (the model's vocabulary); "
                    f"got {low if low < 0 else high}")


def check_init_std(value, error: type = ValueError) -> None:
    """Refuse an init standard deviation that is not a number in (0, 1] (``error`` naming
    model.init_std): past 1 the normal draws of a wide layer overflow or give non-finite losses."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise error(f"model.init_std must be a finite positive number, got {value!r}")
    if value > 1:
        raise error(f"model.init_std must be at most 1 (the standard deviation of the weights' normal "
                    f"init; 0.02 is usual), got {value!r}")


@torch.no_grad()
def init_normal_(model: nn.Module, seed: int, std: float, n_layer: int, *,
                 is_one: Callable[[str], bool], is_residual_out: Callable[[str], bool],
                 is_zero: Callable[[str], bool] = lambda name: False) -> None:
    """Deterministic init from ``seed`` with a private generator (the global RNG is untouched):
    zeros where ``is_zero``, ones where ``is_one`` (norm gains), else Normal(0, std), with residual
    output projections at std / sqrt(2 * n_layer) so the residual stream does not grow with depth.
    Parameters are visited in ``named_parameters`` order (a tied tensor once), so the same seed
    gives the same values."""
    gen = torch.Generator().manual_seed(check_seed(seed))
    residual_std = std / math.sqrt(2 * n_layer)
    for name, p in model.named_parameters():
        if is_zero(name):
            p.zero_()
        elif is_one(name):
            p.fill_(1.0)
        else:
            values = torch.empty(p.shape, dtype=torch.float32)
            values.normal_(0.0, residual_std if is_residual_out(name) else std, generator=gen)
            p.copy_(values)


__all__ = ["MAX_SEED", "check_seed", "extend_cache", "TOKEN_ID_DTYPES", "check_token_ids", "check_init_std", "REGION_MARK",
           "forward_through", "row_losses", "BlockSequence", "BlockModel", "ProjectionHead", "skip_default_init", "init_normal_"]
