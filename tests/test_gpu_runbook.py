"""bench/gpu_runbook.sh's plan (RUNBOOK_PLAN: the steps listed, not run): each call docs/gpu.md
names fits one ten-minute device call and starts with the build, and each bench step selects the
rows it is meant to measure. A GPU loan is rare: a step that selects no row, or the wrong ones,
or outlives its call, would waste it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import block_step  # noqa: E402
import gpu_throughput as gt  # noqa: E402

CALL_LIMIT_S = 590  # a device call runs at most 600 s; 10 s for copying its files back
KILL_AFTER_S = 5  # a step outliving its limit gets SIGKILL this much later (timeout --kill-after)
CALLS = [[], ["build", "blocks", "head"], ["build", "quick", "code"], ["build", "quick-serial"], ["build", "mps"],
         ["build", "360m"], ["build", "360m-more"], ["build", "profile"],
         ["build", "attention", "pipeline-graphs"], ["build", "tests", "p2p"], ["build", "autotune"],
         ["build", "clip"], ["build", "ckpt"], ["build", "docmask"]]  # [] = build 135m

ROWS_MPS_ARGS = ["--json", "--models", "smollm-135m", "--seq-lens", "1024", "--row-timeout", "80", "--only",
                 "ours sync adamw,ours 2bw 2st 1gpu adamw ipc", "--skip",
                 "eager,no-copies,bf16-params,max-autotune,stage-compile,graphs,pdl,mix-order,grad-accum-fusion,doc-mask"]
R135, R360, HEAD = "smollm-135m 1024", "smollm-360m 2048", "head C=576 V=49152 1024"
ROWS = {
    "135m": [f"ours sync adamw {R135}", f"ours sync adamw graphs {R135}", f"hf compile adamw {R135}",
             f"ours 2bw 2st 1gpu adamw ipc {R135}", f"ours 2bw 2st 1gpu adamw ipc graphs {R135}"],
    "360m": [f"ours sync adamw graphs {R360}", f"ours sync adamw graphs combo-kernels {R360}",
             f"ours sync adamw graphs grad-accum-fusion {R360}",
             f"ours sync adamw graphs combo-kernels grad-accum-fusion {R360}", f"hf compile adamw {R360}"],
    "360m-more": [f"ours sync adamw graphs {R360}", f"ours sync adamw graphs pdl {R360}",
                  f"ours sync adamw graphs combo-kernels-pdl {R360}", f"ours sync adamw graphs host-check {R360}"],
    "pipeline-graphs": [f"ours sync adamw graphs {R135}", f"ours 2bw 2st 1gpu adamw ipc graphs {R135}"],
    "quick": [f"ours sync adamw graphs {R135}", f"hf compile adamw {R135}",
              f"ours 2bw 2st 1gpu adamw ipc {R135}", f"head-loss plain {HEAD}", f"head-loss fused {HEAD}"],
    "quick-serial": [f"ours sync adamw graphs {R135}", f"hf compile adamw {R135}",
                     f"ours 2bw 2st 1gpu adamw ipc {R135}", f"head-loss plain {HEAD}", f"head-loss fused {HEAD}"],
    "head": [f"head-loss plain {HEAD}", f"head-loss fused {HEAD}", f"head-loss fused 682 rows {HEAD}",
             f"head-loss fused 4096 rows {HEAD}"],
    "profile": [f"ours sync adamw graphs {R135}"],
    "autotune": [f"ours sync adamw graphs {R360}", f"ours sync adamw graphs max-autotune {R360}"],
    "clip": [f"ours sync adamw graphs {R360}", f"ours sync adamw graphs clip {R360}"],
    "docmask": [f"ours sync adamw {R360}", f"ours sync adamw doc-mask {R360}",
                f"ours sync adamw doc-mask flex-attention {R360}"],
    "mps-off": [f"ours sync adamw {R135}", f"ours 2bw 2st 1gpu adamw ipc {R135}"],
    "mps": [f"ours sync adamw {R135}", f"ours 2bw 2st 1gpu adamw ipc {R135}"],
}


def _plan(tmp_path: Path, steps: list) -> list:
    """(name, limit, command) of each step ``bench/gpu_runbook.sh STEPS`` would run."""
    plan = tmp_path / f"plan-{'-'.join(steps) or 'default'}.txt"
    env = dict(os.environ, RUNBOOK_PLAN=str(plan), OUT=str(tmp_path / "out"))
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_runbook.sh"), *steps], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()  # a plan runs nothing and writes nothing else
    out = []
    for line in plan.read_text().splitlines():
        name, limit, command = line.split("\x1f", 2)
        out.append((name, int(limit), command.split("\x1f")))
    return out


@pytest.fixture(scope="module")
def cli_flags():
    return gt.detect_cli_flags()


@pytest.mark.parametrize("steps", CALLS, ids=lambda s: "-".join(s) or "default")
def test_each_call_fits_a_device_call_and_selects_its_rows(tmp_path, cli_flags, steps):
    plan = _plan(tmp_path, steps)
    assert [name for name, _, _ in plan[:2]] == ["build", "info"]  # a later call may get a fresh machine
    assert sum(limit + KILL_AFTER_S for _, limit, _ in plan) <= CALL_LIMIT_S, plan
    benches = [(n, lim, cmd) for n, lim, cmd in plan if "bench/gpu_throughput.py" in cmd]
    assert benches or steps in (["build", "tests", "p2p"], ["build", "ckpt"])
    if "ckpt" in steps:  # the checkpoint overlap bench on the GPU
        (command,) = [cmd for name, _, cmd in plan if name == "ckpt"]
        assert "bench/checkpoint_overlap.py" in command and command[command.index("--device") + 1] == "cuda"
    if "attention" in steps:
        assert any("bench/attention_kernels.py" in cmd for _, _, cmd in plan)
    if "blocks" in steps:
        assert any("bench/block_step.py" in cmd for _, _, cmd in plan)
    if "code" in steps:  # the compiled block alone, its generated code logged
        (command,) = [cmd for name, _, cmd in plan if name == "code"]
        assert "TORCH_LOGS=output_code" in command and "bench/block_step.py" in command
        with pytest.MonkeyPatch.context() as mp:  # parsed as on the GPU machine
            mp.setattr(torch.cuda, "is_available", lambda: True)
            args = block_step.parse(command[command.index("bench/block_step.py") + 1:])
        assert args.variants == ["compiled"] and not args.profile and args.json.endswith("/code.json")
    for name, limit, command in benches:
        args = gt.parse_args(command[command.index("bench/gpu_throughput.py") + 1:])
        assert args.json.endswith(f"/{name}.json")
        assert args.row_timeout < limit, (name, args.row_timeout)  # a stuck row ends before its step
        assert args.prestart is (name != "quick-serial")  # on CUDA rows start ahead unless told not to
        args.auto_attention = "cudnn"  # as on a Hopper GPU, where the runbook runs
        rows, _ = gt.build_plan(args, cli_flags, gpus=1)
        assert [f"{r['name']} {r['model']} {r['seq_len']}" for r in rows] == ROWS[name]


def test_the_mps_step_runs_the_same_rows_without_then_with_a_private_mps_server(tmp_path):
    (off_name, _, off), (on_name, _, on) = _plan(tmp_path, ["mps"])
    assert (off_name, on_name) == ("mps-off", "mps") and on[:2] == ["bash", "bench/with_mps.sh"]
    assert "with_mps.sh" not in " ".join(off)
    bench_args = [cmd[cmd.index("bench/gpu_throughput.py") + 1:] for cmd in (off, on)]
    assert [[a for a in args if not a.endswith(".json")] for args in bench_args] == [ROWS_MPS_ARGS] * 2
