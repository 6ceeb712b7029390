"""Run as a script: write checkpoint 10, then die by SIGKILL at a chosen point of writing the
next one (argv: run_dir, point, next_step)."""
import os
import signal
import sys

import torch

from asyncpp_ext.training import checkpoint as ckpt


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"schedule": "2bw", "steps_done": seed, "params": {"w": torch.randn(64, 64, generator=g)},
            "stash": {"w": torch.randn(64, 64, generator=g)}, "optimizer": {"state": {}, "param_groups": []}}


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    run_dir, point, next_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    meta = {"config": {}, "data": {}}
    ckpt.save_checkpoint(run_dir, 10, [_state(10)], {**meta})
    if point == "mid-shard":  # half of the shard's bytes reach the disk
        real_save = torch.save

        def half_then_die(obj, f):
            real_save(obj, f)
            f.truncate(f.tell() // 2)
            f.flush()
            _die()
        torch.save = half_then_die
    elif point == "before-rename":
        ckpt.os.replace = lambda *a: _die()
    elif point == "between-renames":  # re-writing an existing step: old moved away, new not in place
        real_replace, calls = os.replace, []

        def second_dies(src, dst):
            calls.append(1)
            if len(calls) == 2:
                _die()
            real_replace(src, dst)
        ckpt.os.replace = second_dies
    ckpt.save_checkpoint(run_dir, next_step, [_state(next_step)], {**meta})
    sys.exit("the kill point was not reached")
