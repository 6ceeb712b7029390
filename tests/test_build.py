"""The package builds, reports what it is, and rejects bad build settings with one clear line."""
from __future__ import annotations

import json
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
    built, runnable = info["cpu_kernel_isas_built"], info["cpu_kernel_isas_runnable"]
    assert built[0] == "baseline" and set(built) <= {"baseline", "avx2", "avx512f"}, built
    assert runnable[0] == "baseline" and set(runnable) <= set(built), (runnable, built)
    assert info["cpu_kernel_isa"] in runnable  # auto, or whatever $ASYNCPP_CPU_ISA forces
    assert info["cpu_kernel_isa_reason"] and "cpu_kernel_isa_error" not in info


def _expected_archs() -> set:
    """(major, minor, sass, ptx) the build was asked for: TORCH_CUDA_ARCH_LIST ("8.6;9.0+PTX":
    SASS each, PTX where +PTX) when set, else setup.py's default, SASS for 8.0/8.6/8.9/9.0 + PTX 9.0."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not spec:
        return {(8, 0, True, False), (8, 6, True, False), (8, 9, True, False), (9, 0, True, True)}
    out = set()
    for item in spec.replace(" ", ";").split(";"):
        if item:
            major, minor = item.split("+")[0].split(".")
            out.add((int(major), int(minor.rstrip("af")), True, item.endswith("+PTX")))
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None or os.environ.get("ASYNCPP_CUDA") == "off",
                    reason="default build compiles CUDA only where nvcc exists")
def test_cuda_build_compiled_the_requested_archs():
    from asyncpp_ext.optim._kernels import parse_cuda_archs

    info = asyncpp_ext.build_info()
    assert info["cuda_compiled"] is True
    built = {(major, minor, sass, ptx) for major, minor, _, sass, ptx in parse_cuda_archs(info["cuda_archs"])}
    assert built == _expected_archs(), info["cuda_archs"]


@pytest.mark.parametrize("capability,archs,runs", [
    ((9, 0), "80-real;86-real;89-real;90", "SASS sm_90"),
    ((8, 6), "80-real;86-real;89-real;90", "SASS sm_86"),
    ((8, 7), "80-real;86-real;89-real;90", "SASS sm_86"),       # Orin: sm_86 SASS is binary compatible
    ((12, 0), "80-real;86-real;89-real;90", "PTX compute_90 (JIT)"),  # newer GPUs JIT the 9.0 PTX
    ((10, 0), "80-real;86-real;89-real;90", "PTX compute_90 (JIT)"),
    ((8, 9), "80-real;90", "SASS sm_80"),
    ((8, 6), "90", None),                                         # PTX for 9.0 cannot run on 8.x
    ((7, 5), "80-real;86-real;89-real;90", None),
    ((9, 0), "80-real;89-real", None),                            # SASS never crosses a major version
    ((9, 0), "90a-real", "SASS sm_90a"),
    ((10, 0), "90a", None),                                       # arch-specific code: that GPU only
    ((8, 0), "80-virtual", "PTX compute_80 (JIT)"),
    ((8, 0), "80-virtual;75-real", "PTX compute_80 (JIT)"),
    ((8, 0), "", None),
    ((8, 0), "native", "unknown"),
])
def test_cuda_arch_coverage_decides_like_the_cuda_loader(capability, archs, runs):
    from asyncpp_ext.optim._kernels import cuda_arch_coverage

    assert cuda_arch_coverage(capability, archs) == runs


def test_uncovered_gpu_error_names_gpu_capability_archs_and_the_variable(monkeypatch):
    """The decision above, wired into the first CUDA kernel use, with torch's answers faked."""
    import torch

    from asyncpp_ext.optim import _kernels

    monkeypatch.setattr(_kernels, "_cuda_usable", True)
    monkeypatch.setattr(_kernels, "_arch_checked", set())
    monkeypatch.setattr(_kernels, "C", type("FakeC", (), {"build_config": staticmethod(
        lambda: {"cuda_archs": "90", "nvcc_version": "13.0"})}))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA GeForce RTX 3090")
    with pytest.raises(RuntimeError) as info:
        _kernels._check_cuda_kernels(torch.device("cuda", 1))
    msg = str(info.value)
    for part in ("cuda:1", "NVIDIA GeForce RTX 3090", "compute capability 8.6", "CUDA archs 90",
                 'TORCH_CUDA_ARCH_LIST="8.6"', "--no-build-isolation --no-deps"):
        assert part in msg, (part, msg)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    _kernels._check_cuda_kernels(torch.device("cuda", 1))  # covered: no error, remembered
    assert _kernels._arch_checked == {1}


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
out32, sumsq32 = new(), torch.empty(3)
K.muon_momentum(grad, m, out32, momentum=0.9, nesterov=False, sumsq=sumsq32)
K.apply_update(p, out, e, [-0.02] * 3, [False] * 3, lr=0.02, weight_decay=0.1, ef_beta=0.5)
h = hashlib.sha256()
for t in p + m + v + e + out + out32 + [sumsq, sumsq32]:
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


# The same in a process with ASYNCPP_CPU_ISA set, then what that process's build_info says.
ISA_PROBE = KERNEL_DIGEST + """
import json, asyncpp_ext
info = asyncpp_ext.build_info()
print(json.dumps({k: v for k, v in info.items() if k.startswith("cpu_kernel_isa")}))
"""

# Imports, reports and validates without running a kernel: none of it may raise on a bad setting.
REFUSAL_PROBE = """
import json, asyncpp_ext
from asyncpp_ext._ext import C
info = asyncpp_ext.build_info()
try:
    C.cpu_kernel_isa_check()
    check = None
except ValueError as e:
    check = str(e)
print(json.dumps(dict(isa=info["cpu_kernel_isa"], error=info.get("cpu_kernel_isa_error"), check=check)))
"""


def _env_spelling(isa: str) -> str:
    return "avx512" if isa == "avx512f" else isa


def _with_isa(value: str, script: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(env or os.environ, ASYNCPP_CPU_ISA=value)
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_every_isa_this_cpu_runs_gives_the_baseline_bits():
    """Each runnable variant forced by ASYNCPP_CPU_ISA, and auto, computes the baseline's bits and
    reports what ran and why."""
    runnable = asyncpp_ext.build_info()["cpu_kernel_isas_runnable"]
    digests = {}
    for value in runnable + [""]:
        r = _with_isa(value, ISA_PROBE)
        assert r.returncode == 0, r.stderr
        digest, reported = r.stdout.splitlines()
        reported = json.loads(reported)
        if value:
            assert reported["cpu_kernel_isa"] == value, reported
            assert reported["cpu_kernel_isa_reason"] == f"forced by ASYNCPP_CPU_ISA={value}", reported
        else:
            assert reported["cpu_kernel_isa"] == runnable[-1], reported
            assert reported["cpu_kernel_isa_reason"].startswith("auto: "), reported
        digests[value or "auto"] = digest
    assert set(digests.values()) == {digests["baseline"]}, digests


def _assert_refused(value: str, message: str, cwd: Path = ROOT, env: dict | None = None) -> None:
    """The first kernel call raises exactly `message`; import, build_info and the check do not
    get in the way."""
    r = _with_isa(value, KERNEL_DIGEST, cwd, env)
    assert r.returncode != 0
    assert [l for l in r.stderr.splitlines() if "ASYNCPP_CPU_ISA" in l] == [f"ValueError: {message}"], r.stderr
    r = _with_isa(value, REFUSAL_PROBE, cwd, env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == dict(isa=None, error=message, check=message)


def test_an_isa_this_cpu_cannot_run_is_one_clear_error():
    info = asyncpp_ext.build_info()
    built, runnable = info["cpu_kernel_isas_built"], info["cpu_kernel_isas_runnable"]
    unrunnable = [isa for isa in built if isa not in runnable]
    if not unrunnable:
        pytest.skip(f"this CPU runs every built ISA ({', '.join(built)}): none to refuse")
    usable = ", ".join(["auto"] + [_env_spelling(isa) for isa in runnable])
    for isa in unrunnable:
        value = _env_spelling(isa)
        _assert_refused(value, f"ASYNCPP_CPU_ISA={value}: this CPU does not support {isa}; "
                               f"use one of {usable} (or unset it)")


def test_unknown_isa_is_one_clear_error_and_info_still_runs():
    runnable = asyncpp_ext.build_info()["cpu_kernel_isas_runnable"]
    usable = ", ".join(["auto"] + [_env_spelling(isa) for isa in runnable])
    message = f"ASYNCPP_CPU_ISA=sse9: not a known ISA; use one of {usable} (or unset it)"
    _assert_refused("sse9", message)
    out = subprocess.run([sys.executable, "-m", "asyncpp_ext.info", "--json"], capture_output=True, text=True,
                         env=dict(os.environ, ASYNCPP_CPU_ISA="sse9"), timeout=300)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert json.loads(out.stdout)["cpu_kernel_isa_error"] == message


def test_isa_variant_objects_define_nothing_outside_their_namespace():
    """The per-ISA units (optim_cpu_loops.h) share headers of inline helpers. An out-of-line copy
    of one emitted by the AVX-512 unit would be merged by the linker with every other unit's, and
    the baseline could then run AVX-512 code. So each object may define only its own namespace."""
    kernels = ROOT / "build" / f"cmake-py{sys.version_info[0]}{sys.version_info[1]}" / "CMakeFiles" \
        / "asyncpp_kernels.dir" / "csrc" / "kernels"
    objects = sorted(kernels.glob("optim_cpu_*.cpp.o"))
    if not objects or shutil.which("nm") is None:
        pytest.skip(f"needs nm and the build tree setup.py writes ({kernels})")
    for obj in objects:
        isa = obj.name[len("optim_cpu_"):-len(".cpp.o")]
        out = subprocess.run(["nm", "-C", "--defined-only", "--extern-only", str(obj)], capture_output=True,
                             text=True, check=True).stdout
        foreign = [line for line in out.splitlines() if f"::isa_{isa}::" not in line]
        assert not foreign, f"{obj.name} defines symbols shared with the other ISA units: {foreign}"


def _defined_dynamic_symbols(module: Path) -> list:
    out = subprocess.run(["nm", "-D", "--defined-only", str(module)], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


def test_the_module_exports_its_init_function_alone():
    """cmake/module_exports.map: nothing but PyInit__C is visible outside _C, so no symbol of ours,
    of cudart or of a static libstdc++ can be mixed up with the copies torch loaded."""
    if shutil.which("nm") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs nm (binutils) on Linux")
    assert _defined_dynamic_symbols(Path(asyncpp_ext._C.__file__)) == ["PyInit__C"]


# A bad channel list: its refusal formats integers (the stream code a static libstdc++ copy broke).
BAD_CHANNEL_PROBE = """
import torch  # loads the shared libstdc++ first, as in every real use
from asyncpp_ext import _C
class NoReceives:
    def new_recv_buffer(self, kind):
        raise AssertionError
try:
    _C.NcclTransport(1, 0, 0, [(0, True, 0, 1, b"x" * 128)], _C.MessageBoard(NoReceives()))
except ValueError as e:
    print(e)
"""


@pytest.mark.buildcheck
def test_cuda_off_build_skips_cuda_and_imports(tmp_path):
    """A full CPU-only, baseline-ISA-only build into a scratch copy of the package, then import it
    there. Its kernels must give the very bits the main build's ISA variant gives (cpu_isa.h), and
    an ISA it did not build is refused. It links libstdc++ statically, as some toolchains do (one
    GPU machine's did): its C++ error messages must still format, which needs the module to keep
    that copy to itself."""
    import pybind11

    pkg = tmp_path / "asyncpp_ext"
    shutil.copytree(ROOT / "asyncpp_ext", pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    build = tmp_path / "build"
    # Build type None: no optimisation flags for the bindings (and no link-time optimisation),
    # ~25 % less build time; the kernels carry their own -O3 and FP flags (CMakeLists.txt), which
    # is what the bitwise comparison below is about.
    configure = [_cmake(), "-S", str(ROOT), "-B", str(build), "-DASYNCPP_CUDA=off", "-DCMAKE_BUILD_TYPE=None",
                 "-DCMAKE_CXX_FLAGS=-DASYNCPP_NO_ISA_CLONES", "-DCMAKE_MODULE_LINKER_FLAGS=-static-libstdc++",
                 f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={pkg}", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]
    subprocess.run(configure, check=True, capture_output=True, timeout=300)
    subprocess.run([_cmake(), "--build", str(build), "--parallel", "2"], check=True,
                   capture_output=True, timeout=600)
    probe = "import asyncpp_ext, json; print(json.dumps(asyncpp_ext.build_info()))"
    # Both builds choose for themselves (auto), whatever ASYNCPP_CPU_ISA the suite runs under.
    main_env = {k: v for k, v in os.environ.items() if k != "ASYNCPP_CPU_ISA"}
    scratch_env = dict(main_env, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         check=True, env=scratch_env)

    info = json.loads(out.stdout)
    assert info["cuda_compiled"] is False and info["cuda_archs"] == ""
    assert info["cpu_kernel_isa"] == "baseline" and info["cpu_kernel_isas_built"] == ["baseline"]
    assert "ASYNCPP_NO_ISA_CLONES" in info["cpu_kernel_isa_reason"]
    digests = [subprocess.run([sys.executable, "-c", KERNEL_DIGEST], cwd=cwd, env=env, capture_output=True,
                              text=True, check=True).stdout for cwd, env in ((tmp_path, scratch_env), (ROOT, main_env))]
    assert digests[0] == digests[1], "the baseline-only build vs the main build's best variant"
    refusal = subprocess.run([sys.executable, "-c", BAD_CHANNEL_PROBE], cwd=tmp_path, capture_output=True, text=True,
                             env=scratch_env, timeout=120)
    assert refusal.returncode == 0 and refusal.stdout.startswith(
        "channels[0]: stage 1 sends activations to stage 2, not stage 0"), (refusal.returncode, refusal.stdout,
                                                                             refusal.stderr[-2000:])
    if shutil.which("nm") is not None:
        assert _defined_dynamic_symbols(next(pkg.glob("_C*.so"))) == ["PyInit__C"]
    _assert_refused("avx2", "ASYNCPP_CPU_ISA=avx2: this build has no avx2 variant (it was built with "
                            "-DASYNCPP_NO_ISA_CLONES); use one of auto, baseline (or unset it)", tmp_path, scratch_env)
