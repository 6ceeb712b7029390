"""What this installation is: ``build_info()`` and ``python -m asyncpp_ext.info``.

Safe on machines without a GPU even when CUDA kernels were compiled: the CUDA runtime is linked
statically and only asked how many devices it sees.
"""
from __future__ import annotations

import argparse
import json


def build_info() -> dict:
    """Version, compiler, CUDA kernels and archs, NCCL loadability, GPU visibility, torch version."""
    from ._ext import C
    from .pipeline.nccl import nccl_candidates

    info = dict(C.build_config())
    nccl = C.nccl_load(nccl_candidates())
    info["nccl_loadable"] = bool(nccl["ok"])
    info["nccl_library"] = nccl["path"] if nccl["ok"] else None
    info["nccl_version"] = nccl["version"] if nccl["ok"] else None
    if not nccl["ok"]:
        info["nccl_error"] = nccl["error"]
    info["cuda_devices"] = int(C.cuda_device_count())
    info["gpu_visible"] = info["cuda_devices"] > 0
    try:
        import torch

        info["torch_version"] = torch.__version__
        info["torch_cuda_available"] = bool(torch.cuda.is_available())
        info["gpu_visible"] = info["gpu_visible"] or info["torch_cuda_available"]
    except ImportError:
        info["torch_version"] = None
        info["torch_cuda_available"] = False
    info.update(_bf16_matmul_info())
    return info


def _bf16_matmul_info() -> dict:
    """The CPU bf16 Newton-Schulz path ($ASYNCPP_BF16_MATMUL or the CPU); an invalid setting is
    reported here, not raised: the optimizer raises it when it runs."""
    from .optim.newton_schulz import bf16_matmul_choice

    try:
        mode, reason = bf16_matmul_choice()
    except ValueError as e:
        return {"bf16_matmul": None, "bf16_matmul_reason": None, "bf16_matmul_error": str(e)}
    return {"bf16_matmul": mode, "bf16_matmul_reason": reason}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncpp_ext.info",
                                     description="What this asyncpp_ext build is and what it chose on this "
                                                 "machine: compiler, CUDA archs, NCCL, CPU kernel ISA, bf16 path.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    info = build_info()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    width = max(len(k) for k in info)
    print("asyncpp_ext build info")
    for key, value in info.items():
        print(f"  {key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
