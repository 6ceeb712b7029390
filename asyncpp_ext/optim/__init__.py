"""Optimizers with fused CPU/CUDA kernels: Muon, AdamW, the Muon+AdamW hybrid, and the
error-feedback (EF) delay correction, fused (`ef_beta=`) or as a wrapper for any optimizer, and
the versioned step (W(t+1) written into another buffer than W(t))."""
from .error_feedback import ErrorFeedback
from .errors import NonFiniteGradientError
from .factory import build_optimizer
from .newton_schulz import orthogonalize
from .optimizers import AdamW, Muon, MuonHybrid
from .routing import split_named_parameters
from .versioned import EF_SOURCES, step_versioned, wants_previous_weights

__all__ = ["AdamW", "Muon", "MuonHybrid", "ErrorFeedback", "NonFiniteGradientError", "build_optimizer",
           "orthogonalize", "split_named_parameters", "EF_SOURCES", "step_versioned", "wants_previous_weights"]
