"""Measured (not estimated) memory of a stage: weights, optimizer state, and the activations that
autograd keeps alive for microbatches in flight.

Activation bytes are counted through autograd's saved-tensor hooks: every tensor a forward saves
for its backward is counted once per storage while any saved reference to it lives, excluding the
stage's weight buffers (saved weights are not activations). The peak over a run is what the
schedule's in-flight microbatches cost.
"""
from __future__ import annotations

import contextlib

import torch


class _Saved:
    """A saved tensor plus the bookkeeping that releases its bytes when autograd drops it."""
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter", key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class ActivationMeter:
    def __init__(self, exclude: list[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            return _Saved(t, self, None)
        key = storage.data_ptr()
        if key in self._excluded or key == 0:
            return _Saved(t, self, None)
        if key not in self._refs:
            self._refs[key] = 0
            self._bytes[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._refs[key] += 1
        return _Saved(t, self, key)

    def hold(self, t: torch.Tensor):
        """Count ``t`` as in-flight until the returned token is dropped (a tensor a stage keeps
        for later outside autograd, e.g. the input kept for recomputation)."""
        return self._pack(t)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.current -= self._bytes.pop(key)

    @contextlib.contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(optimizer) -> int:
    if optimizer is None:
        return 0
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))
