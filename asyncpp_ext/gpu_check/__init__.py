"""The GPU proof kit: ``python -m asyncpp_ext.gpu_check [--out DIR] [--quick]`` (``make gpu-check``).

On a machine with a GPU it runs every section (environment, the cuda-marked tests, the NCCL
self-test, a 2-stage pipeline trained on one GPU and compared with the CPU simulator, the nccl and
torch transports where there are two GPUs, the optimizer and p2p benchmarks) and writes
``DIR/report.md`` and ``DIR/report.json``; the exit code is 1 when a section failed. Without a GPU
it prints what it would run, writes a report saying nothing was run and exits 0. docs/gpu.md says
what each section checks and what its figures mean.
"""
from .report import compare_losses, parse_junit, render_markdown  # noqa: F401
from .runner import main  # noqa: F401
