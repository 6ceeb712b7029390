"""A process killed (SIGKILL) while writing a checkpoint leaves the previous one loadable."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncpp_ext.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

from .ckpt_crash_worker import _state

WORKER = Path(__file__).with_name("ckpt_crash_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("point, next_step", [("mid-shard", 20), ("before-rename", 20),
                                              ("between-renames", 10)])
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, point, next_step):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path), point, str(next_step)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == -9, done.stderr  # killed at the chosen point
    meta, shards = load_checkpoint(latest_checkpoint(tmp_path))
    assert meta["step"] == 10
    assert torch.equal(shards[0]["engine"]["params"]["w"], _state(10)["params"]["w"])
    # the next write of any step succeeds and cleans up what the killed one left
    save_checkpoint(tmp_path, 30, [_state(30)], {"config": {}, "data": {}})
    save_checkpoint(tmp_path, next_step, [_state(next_step)], {"config": {}, "data": {}})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted({"ckpt-000010", f"ckpt-{next_step:06d}", "ckpt-000030"}), names
