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
                "gpu_visible", "torch_version"):
        assert key in info, key
    assert info["version"] == asyncpp_ext.__version__
    import torch

    assert info["torch_version"] == torch.__version__
    assert isinstance(info["nccl_loadable"], bool)


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


def test_cuda_off_build_skips_cuda_and_imports(tmp_path):
    """A full CPU-only build into a scratch copy of the package, then import it there."""
    import pybind11

    pkg = tmp_path / "asyncpp_ext"
    shutil.copytree(ROOT / "asyncpp_ext", pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    build = tmp_path / "build"
    configure = [_cmake(), "-S", str(ROOT), "-B", str(build), "-DASYNCPP_CUDA=off",
                 f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={pkg}", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]
    subprocess.run(configure, check=True, capture_output=True, timeout=300)
    subprocess.run([_cmake(), "--build", str(build), "--parallel", "2"], check=True,
                   capture_output=True, timeout=600)
    probe = "import asyncpp_ext, json; print(json.dumps(asyncpp_ext.build_info()))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    import json

    info = json.loads(out.stdout)
    assert info["cuda_compiled"] is False and info["cuda_archs"] == ""
