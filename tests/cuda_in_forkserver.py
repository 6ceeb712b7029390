"""Imported into a forkserver by tests/test_launch.py: every child the server forks afterwards sees
itself in torch's "bad fork" state, as after an import that touches CUDA in the server on a GPU
machine (torch then refuses CUDA in the child). With ASYNCPP_TEST_FORKSERVER_PROBE=fails the
children's check raises instead: a probe that cannot run."""
import os

import torch


def _fails():
    raise RuntimeError("a probe that cannot run")


torch._C._cuda_isInBadFork = _fails if os.environ.get("ASYNCPP_TEST_FORKSERVER_PROBE") == "fails" else (lambda: True)
