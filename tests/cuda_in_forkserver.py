"""Imported into a forkserver by tests/test_launch.py: every child the server forks afterwards sees
itself in torch's "bad fork" state, as after an import that initialises CUDA in the server on a
GPU machine (torch then refuses CUDA in the child)."""
import torch

torch._C._cuda_isInBadFork = lambda: True
