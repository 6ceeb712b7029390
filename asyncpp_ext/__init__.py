"""asyncpp: asynchronous pipeline-parallel training (PipeDream-2BW) with Muon and EF correction.

Layers, each depending only on the ones after it:
  Python (this package)  ->  asyncpp_ext._C bindings  ->  kernels / transports  ->  torch-free core
"""
from ._version import __version__


def build_info() -> dict:
    """Version, compiler, CUDA kernels and archs, NCCL loadability, GPU visibility, torch version."""
    from .info import build_info as _build_info

    return _build_info()


__all__ = ["__version__", "build_info"]
