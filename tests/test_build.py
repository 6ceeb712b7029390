"""The package builds, reports what it is, and rejects bad build settings with one clear line."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import asyncpp_ext

ROOT = Path(__file__).resolve().parents[1]


def test_build_info_reports_every_field():
    info = asyncpp_ext.build_info()
    for key in ("version", "cxx_compiler", "cuda_compiled", "cuda_archs", "nccl_loadable",
                "gpu_visible", "torch_version", "cpu_kernel_isa"):
        assert key in info, key
    assert info["version"] == asyncpp_ext.__version__
    import torch

    assert info["torch_version"] == torch.__version__
    assert isinstance(info["nccl_loadable"], bool)
    assert info["cpu_kernel_isa"] in ("avx512f", "avx2", "baseline")


@pytest.mark.skipif(shutil.which("nvcc") is None or os.environ.get("ASYNCPP_CUDA") == "off",
                    reason="default build compiles CUDA only where nvcc exists")
def test_default_build_compiled_cuda_for_sm80_and_sm90():
    info = asyncpp_ext.build_info()
    assert info["cuda_compiled"] is True
    archs = info["cuda_archs"]
    assert "80" in archs and "90" in archs, archs


def test_info_cli_runs_without_gpu():
    out = subprocess.run([sys.executable, "-m", "asyncpp_ext.info"], capture_output=True, text=True,
                         check=True)
    assert "cuda_compiled" in out.stdout and out.stderr == ""


def _setup_py(env_overrides: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_overrides)
    return subprocess.run([sys.executable, str(ROOT / "setup.py"), "build_ext", "-b", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)


def test_unknown_cuda_mode_is_one_clear_line(tmp_path):
    r = _setup_py({"ASYNCPP_CUDA": "maybe"}, tmp_path)
    assert r.returncode != 0
    errors = [l for l in r.stderr.splitlines() if "asyncpp_ext build" in l]
    assert len(errors) == 1 and "ASYNCPP_CUDA='maybe'" in errors[0] and "auto, on, off" in errors[0]
    assert "Traceback" not in r.stderr


def test_missing_compiler_is_one_clear_line(tmp_path):
    r = _setup_py({"CXX": "/nonexistent/g++"}, tmp_path)
    assert r.returncode != 0
    errors = [l for l in r.stderr.splitlines() if "asyncpp_ext build" in l]
    assert len(errors) == 1 and "no C++ compiler found" in errors[0]
    assert "Traceback" not in r.stderr


def _cmake() -> str:
    import cmake  # installed with the build requirements

    return os.path.join(cmake.CMAKE_BIN_DIR, "cmake")


def test_cuda_on_without_nvcc_is_a_configure_error(tmp_path):
    env = dict(os.environ, PATH="/usr/bin:/bin", CUDACXX="/nonexistent/nvcc")
    r = subprocess.run([_cmake(), "-S", str(ROOT), "-B", str(tmp_path), "-DASYNCPP_CUDA=on"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "ASYNCPP_CUDA=on but no CUDA compiler (nvcc) was found" in r.stderr


# Runs the three CPU kernels on seeded data and prints a digest of every output bit.
KERNEL_DIGEST = """
import hashlib, torch
from asyncpp_ext.optim import _kernels as K
g = torch.Generator().manual_seed(0)
shapes = [(300, 200), (77,), (1000, 33)]
new = lambda: [torch.randn(s, generator=g) for s in shapes]
p, grad, m, v, e = new(), new(), new(), [t.abs() for t in new()], new()
K.adamw_step(p, grad, m, v, e, [3] * 3, [False] * 3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
             weight_decay=0.01, ef_beta=0.5)
out, sumsq = [torch.empty(s, dtype=torch.bfloat16) for s in shapes], torch.empty(3)
K.muon_momentum(grad, m, out, momentum=0.95, nesterov=True, sumsq=sumsq)
K.apply_update(p, out, e, [-0.02] * 3, [False] * 3, lr=0.02, weight_decay=0.1, ef_beta=0.5)
h = hashlib.sha256()
for t in p + m + v + e + out + [sumsq]:
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


def test_cuda_off_build_skips_cuda_and_imports(tmp_path):
    """A full CPU-only, baseline-ISA-only build into a scratch copy of the package, then import it
    there. Its kernels must give the very bits the main build's ISA clones give (cpu_isa.h)."""
    import pybind11

    pkg = tmp_path / "asyncpp_ext"
    shutil.copytree(ROOT / "asyncpp_ext", pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    build = tmp_path / "build"
    configure = [_cmake(), "-S", str(ROOT), "-B", str(build), "-DASYNCPP_CUDA=off",
                 "-DCMAKE_CXX_FLAGS=-DASYNCPP_NO_ISA_CLONES",
                 f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={pkg}", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]
    subprocess.run(configure, check=True, capture_output=True, timeout=300)
    subprocess.run([_cmake(), "--build", str(build), "--parallel", "2"], check=True,
                   capture_output=True, timeout=600)
    probe = "import asyncpp_ext, json; print(json.dumps(asyncpp_ext.build_info()))"
    scratch_env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         check=True, env=scratch_env)
    import json

    info = json.loads(out.stdout)
    assert info["cuda_compiled"] is False and info["cuda_archs"] == ""
    assert info["cpu_kernel_isa"] == "baseline"
    digests = [subprocess.run([sys.executable, "-c", KERNEL_DIGEST], cwd=cwd, env=env, capture_output=True,
                              text=True, check=True).stdout for cwd, env in ((tmp_path, scratch_env), (ROOT, None))]
    assert digests[0] == digests[1], f"baseline build vs {asyncpp_ext.build_info()['cpu_kernel_isa']} clones"
