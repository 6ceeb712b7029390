"""Build driver: setuptools hands the one extension module, ``asyncpp_ext._C``, to CMake.

Environment knobs (all optional):
  ASYNCPP_CUDA          auto (default) | on | off. ``auto`` compiles the CUDA kernels when nvcc
                        is found (a GPU need not be visible); ``on`` makes a missing nvcc an
                        error; ``off`` skips CUDA entirely.
  TORCH_CUDA_ARCH_LIST  e.g. "8.0;9.0+PTX" (one arch builds fastest, see docs/gpu.md). Without it:
                        SASS for 8.0, 8.6, 8.9 and 9.0 (A100; RTX 30xx/A10/A40; RTX 40xx/L4/L40;
                        H100/H200) plus PTX for 9.0, which newer GPUs JIT-compile. The same on
                        every machine, whatever GPU is visible while building.
  ASYNCPP_BUILD_TYPE    Release (default) | Debug | RelWithDebInfo.
  MAX_JOBS              parallel compile jobs (default: number of CPUs).
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CUDA_MODES = ("auto", "on", "off")
# SASS for sm_80/86/89/90, plus PTX for 90 (forward compatibility); kept equal to cmake/AsyncppCUDA.cmake.
DEFAULT_CUDA_ARCHS = "80-real;86-real;89-real;90"


def fail(message: str) -> "NoReturn":  # noqa: F821
    """One clear line and a non-zero exit; pip shows it verbatim."""
    sys.stderr.write(f"error: asyncpp_ext build: {message}\n")
    raise SystemExit(2)


def cuda_mode() -> str:
    mode = os.environ.get("ASYNCPP_CUDA", "auto").strip().lower()
    if mode not in CUDA_MODES:
        fail(f"ASYNCPP_CUDA={mode!r} is not one of {', '.join(CUDA_MODES)}; "
             "unset it or pick one of those")
    return mode


def cmake_cuda_archs() -> str:
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX", spaces allowed) -> CMake form ("80-real;90")."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not spec:
        return DEFAULT_CUDA_ARCHS
    archs = []
    for item in re.split(r"[;\s]+", spec):
        m = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", item)
        if not m:
            fail(f"TORCH_CUDA_ARCH_LIST entry {item!r} is not like '8.0' or '9.0+PTX'")
        arch = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        archs.append(arch if m.group(4) else f"{arch}-real")
    return ";".join(archs)


def build_tool(name: str) -> str:
    """cmake/ninja from the build environment's PyPI packages first, then PATH."""
    try:
        mod = __import__(name)
        bin_dir = getattr(mod, "CMAKE_BIN_DIR", None) or getattr(mod, "BIN_DIR", None)
        if bin_dir and os.path.exists(os.path.join(bin_dir, name)):
            return os.path.join(bin_dir, name)
    except ImportError:
        pass
    return shutil.which(name) or name


def require_cxx_compiler() -> None:
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx.split()[0]):
        fail(f"no C++ compiler found (looked for {cxx!r}); install g++ or clang++ "
             "(e.g. apt-get install g++) or point CXX at one")


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        mode = cuda_mode()
        require_cxx_compiler()
        import pybind11  # build requirement, present under build isolation

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        cmake, ninja = build_tool("cmake"), build_tool("ninja")
        # A persistent build tree makes re-builds incremental (make demo/test re-run in seconds).
        # A cache written by another cmake (e.g. a previous isolated build env) is discarded.
        build_dir = ROOT / "build" / f"cmake-py{sys.version_info[0]}{sys.version_info[1]}"
        forget_foreign_cache(build_dir, cmake)
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_BUILD_TYPE={os.environ.get('ASYNCPP_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DASYNCPP_CUDA={mode}",
            f"-DASYNCPP_VERSION={self.distribution.get_version()}",
        ]
        if mode != "off":
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={cmake_cuda_archs()}")
        if shutil.which(ninja):
            if not (build_dir / "CMakeCache.txt").exists():
                args += ["-G", "Ninja"]
            args.append(f"-DCMAKE_MAKE_PROGRAM={shutil.which(ninja)}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        run([cmake, "-S", str(ROOT), "-B", str(build_dir), *args])
        run([cmake, "--build", str(build_dir), "--parallel", jobs])


def forget_foreign_cache(build_dir: Path, cmake: str) -> None:
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    cached = re.search(r"^CMAKE_COMMAND:INTERNAL=(.*)$", cache.read_text(), re.M)
    current = shutil.which(cmake) or cmake
    if not cached or os.path.realpath(cached.group(1)) != os.path.realpath(current):
        cache.unlink()
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)


def run(cmd: list) -> None:
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError:
        fail(f"{cmd[0]!r} not found; pip installs it under build isolation, otherwise "
             f"'pip install {cmd[0]}'")
    except subprocess.CalledProcessError as e:
        fail(f"'{' '.join(cmd[:3])} ...' failed with exit code {e.returncode} (see the output above)")


setup(ext_modules=[CMakeExtension("asyncpp_ext._C")], cmdclass={"build_ext": CMakeBuild})
