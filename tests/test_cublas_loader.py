"""Which cuBLAS the fused weight-gradient product calls (csrc/kernels/cublas_wgrad.cpp): only the
library torch's CUDA version links, never another major version some other library loaded into the
process -- torch's handle may be used only by the library that made it. Checked on any machine with
stand-in libraries: shared objects whose sonames are cuBLAS's, exporting the two functions looked up."""
import shutil
import subprocess
import sys
import textwrap

import pytest

STAND_IN = "int cublasGemmEx(void) { return 0; }\nint cublasGetStream_v2(void) { return 0; }\n"


def _stand_in(tmp_path, soname: str, source: str = STAND_IN) -> str:
    src = tmp_path / "stand_in.c"
    src.write_text(source)
    out = tmp_path / soname
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out),
                    str(src)], check=True)
    return str(out)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
def test_only_torchs_cublas_major_version_is_taken(tmp_path):
    lib13 = _stand_in(tmp_path, "libcublas.so.13")
    script = textwrap.dedent(f"""
        import ctypes
        ctypes.CDLL({lib13!r}, mode=ctypes.RTLD_GLOBAL)  # another library's cuBLAS 13, already loaded
        from asyncpp_ext.optim import _kernels as K
        for soname in ("libcublas.so.12", "libcublas.so.13", ""):
            K._K.set_cublas_soname(soname)
            print(K.cublas_library())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    under12, under13, unset = out.splitlines()
    # torch built for CUDA 12: the loaded 13 is not taken, and the message names what was looked for
    assert under12.startswith("torch has no cuBLAS loaded in this process (libcublas.so.12 with cublasGemmEx "
                              "and cublasGetStream)")
    assert under13 == "libcublas.so.13" and unset == "libcublas.so.13"


def test_the_soname_follows_torchs_cuda_version(monkeypatch):
    import torch
    from asyncpp_ext.optim import _kernels as K
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert K.torch_cublas_soname() == "libcublas.so.12"
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build: any loaded one (none will be)
    assert K.torch_cublas_soname() == ""


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
def test_a_cublas_exporting_the_stream_getter_under_its_plain_name_is_taken(tmp_path):
    lib = _stand_in(tmp_path, "libcublas.so.13", STAND_IN.replace("cublasGetStream_v2", "cublasGetStream"))
    script = textwrap.dedent(f"""
        import ctypes
        ctypes.CDLL({lib!r}, mode=ctypes.RTLD_GLOBAL)
        from asyncpp_ext.optim import _kernels as K
        K._K.set_cublas_soname("libcublas.so.13")
        print(K.cublas_library())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["libcublas.so.13"]
