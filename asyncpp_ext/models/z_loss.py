"""The z-loss (``--z-loss Z``): PaLM's auxiliary loss ``Z * mean_i lse_i^2`` over the rows whose target
counts (lse_i: logsumexp of row i's logits, in fp32), which pulls the softmax normaliser log Z
towards 0 and so keeps the logits from drifting to magnitudes where bf16 loses them.

It goes into the gradient of the last block's loss, not into the loss's value: the rows' ``loss``
stays the cross entropy, comparable with a run without the term and with ``eval_loss`` (as
decoupled weight decay is in the update, not in the loss). The plain path adds ``z_loss_term``
(``plain_loss``); the fused head's chunked kernel forms the term in its gradient pass
(head_loss._chunk_grad); the library kernels do not (``check_kernel_z_loss``).
"""
from __future__ import annotations

import math

import torch


def check_z_loss(z_loss) -> float:
    """``z_loss`` as a float, or ValueError (one line) unless it is a finite number >= 0."""
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"z_loss must be a finite number >= 0 (PaLM's is 1e-4; 0 = off), got {z_loss!r}")
    return float(z_loss)


def z_loss_term(logits: torch.Tensor, targets: torch.Tensor, z_loss: float, ignore_index: int = -100) -> torch.Tensor:
    """A tensor of value 0 whose gradient is that of the z-loss, ``z_loss * mean_i lse_i^2`` over the
    rows i whose target is not ``ignore_index`` (the module docstring): added to a cross entropy it
    leaves the value and adds the term to the gradient. ValueError for a ``z_loss`` check_z_loss refuses."""
    z_loss = check_z_loss(z_loss)
    x = logits.reshape(-1, logits.shape[-1]).float()
    valid = targets.reshape(-1) != ignore_index
    lse = torch.logsumexp(x, dim=1)
    term = torch.where(valid, lse.square(), 0.0).sum() * z_loss / valid.sum().clamp(min=1)
    return term - term.detach()


def plain_loss(loss_fn, logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """``loss_fn(logits, targets)``, with the z-loss's gradient (``z_loss_term``) where ``z_loss`` is
    on and gradients are being formed; z = 0 is ``loss_fn``'s call alone, bit for bit."""
    loss = loss_fn(logits, targets)
    if z_loss and torch.is_grad_enabled():
        return loss + z_loss_term(logits, targets, z_loss)
    return loss


def check_kernel_z_loss(kernel: str, z_loss: float) -> None:
    """ValueError (one line) for a library ``kernel`` named with a ``z_loss``: Liger's and
    cut-cross-entropy's kernels add a z-loss to their value, if at all, not to the gradient alone as
    ``z_loss_term`` defines it, so only the package's chunked kernel ("auto" picks it) forms it."""
    if z_loss and kernel in ("liger", "cce"):
        raise ValueError(f"head-loss kernel {kernel!r} does not form the z-loss's gradient; use the fused "
                         "head's own kernel (--head-loss chunked or auto) or plain, or drop --z-loss")


__all__ = ["check_z_loss", "check_kernel_z_loss", "z_loss_term", "plain_loss"]
