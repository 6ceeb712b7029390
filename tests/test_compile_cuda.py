"""Compiled blocks on a GPU (models/compile.py; skipped without one): compiling is the CUDA default,
and the 2bw weight swap reads the live buffer under bf16 autocast and with parameter views that
are not 16-byte aligned. Shares test_compile.py's helpers, inductor cache and xdist group."""
import copy

import pytest
import torch
from torch import nn

from asyncpp_ext.models.compile import compile_blocks, compile_unavailable_reason, resolve_compile
from asyncpp_ext.pipeline.flat_buffers import flatten_into, point_at

from test_compile import _one_compile_thread, _swap_error  # noqa: F401 (a fixture)


@pytest.mark.cuda
def test_cuda_compiles_by_default():
    assert compile_unavailable_reason("cuda") is None
    assert resolve_compile(None, "cuda") is True


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [True, False])
def test_cuda_weight_swap_under_bf16_autocast(grad):
    # bf16: eager rounds after every op, inductor keeps fused intermediates in float32, so the two
    # differ by bf16 rounding (|output| ~ 3 here); a stale buffer is off by ~0.1 and more.
    assert _swap_error("inductor", grad, device="cuda", autocast=True) <= 5e-2


@pytest.mark.cuda
def test_cuda_misaligned_parameter_views_swap_correctly():
    # A 3-element parameter first puts the next one 12 bytes into the flat buffer: inductor's
    # kernels must not assume 16-byte alignment of parameters that are views of such a buffer
    # (the stage flattens before the first call, so the compile sees the real offsets).
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3))
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return torch.relu(self.lin(x)) * self.a.sum() + 2 * x

    block = Odd().cuda()
    reference = copy.deepcopy(block)
    params = list(block.parameters())
    flat = torch.empty(sum(p.numel() for p in params), device="cuda")
    flatten_into(params, flat)
    compile_blocks([block], device="cuda")
    x = torch.randn(32, 64, device="cuda")
    block(x)
    new = torch.randn_like(flat)
    point_at(params, new)
    point_at(list(reference.parameters()), new.clone())
    assert torch.allclose(block(x), reference(x), rtol=1e-4, atol=1e-4)
