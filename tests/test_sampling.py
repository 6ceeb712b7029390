"""--sampling epoch: consecutive windows in a seeded permutation per epoch (each token an input
once per epoch), a pure function of (seed, position) that resumes bitwise; random stays the default."""
import json
import shutil

import numpy as np
import pytest

from asyncpp_ext.data.batches import BatchStream
from asyncpp_ext.data.errors import DataError
from asyncpp_ext.training.cli import main


def _firsts(batch):
    return [int(row[0]) for inputs, _ in batch for row in inputs]


def test_each_window_once_per_epoch_and_a_new_order_each_epoch():
    tokens = np.arange(1001, dtype=np.int64)  # token value == its offset: a window shows where it starts
    stream = BatchStream(tokens, 2, 3, 10, seed=7, sampling="epoch")
    assert stream.num_windows == 100 and stream.tokens_per_epoch() == 1000
    starts = []
    for _ in range(34):  # 204 windows: two epochs and four windows of a third
        batch = stream.next()
        for inputs, targets in batch:
            assert inputs.shape == targets.shape == (3, 10)
            assert (targets == inputs + 1).all()  # targets are the next tokens
        starts += _firsts(batch)
    epochs = [starts[:100], starts[100:200]]
    for epoch in epochs:
        assert sorted(epoch) == list(range(0, 1000, 10))  # every window once, none twice
    assert epochs[0] != epochs[1]
    # A minibatch straddling two epochs (position 16: windows 96..101) takes the end of one order
    # and the start of the next; rebuilt at any position, the stream gives the same windows.
    fresh = BatchStream(tokens, 2, 3, 10, seed=7, sampling="epoch", position=16)
    assert _firsts(fresh.next()) == starts[96:102]
    assert _firsts(BatchStream(tokens, 2, 3, 10, seed=8, sampling="epoch").next()) != starts[:6]


def test_state_names_the_order_and_a_mismatch_is_refused():
    tokens = np.arange(500, dtype=np.int64)
    epoch = BatchStream(tokens, 1, 2, 8, seed=1, sampling="epoch")
    epoch.next()
    state = epoch.state_dict()
    assert {k: state[k] for k in ("seed", "position", "sampling")} == {"seed": 1, "position": 1, "sampling": "epoch"}
    assert "sampling" not in BatchStream(tokens, 1, 2, 8, seed=1).state_dict()  # old checkpoints unchanged
    with pytest.raises(DataError, match="sampling 'epoch' but this stream uses 'random'"):
        BatchStream(tokens, 1, 2, 8, seed=1).load_state_dict(epoch.state_dict())
    with pytest.raises(DataError, match="sampling 'shuffled' is not one of random, epoch"):
        BatchStream(tokens, 1, 2, 8, sampling="shuffled")


FLAGS = ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "16", "--no-progress", "--threads", "1",
         "--eval-every", "0", "--simulate", "--steps", "6", "--ckpt-every", "3"]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_epoch_run_resumes_bitwise(tmp_path):
    full = tmp_path / "full"
    assert main(FLAGS + ["--sampling", "epoch", "--out", str(full)]) == 0
    assert json.loads((full / "config.json").read_text())["data"]["sampling"] == "epoch"
    assert main(FLAGS + ["--out", str(tmp_path / "random")]) == 0
    assert _losses(full) != _losses(tmp_path / "random")  # the flag changes the batches
    part = tmp_path / "part"  # the run as it stood at step 3: later checkpoints and rows gone
    shutil.copytree(full, part)
    shutil.rmtree(part / "ckpt-000006")
    rows = (part / "metrics.jsonl").read_text().splitlines()
    (part / "metrics.jsonl").write_text("\n".join(rows[:3]) + "\n")
    assert main(["--resume", str(part), "--no-progress"]) == 0
    assert _losses(part) == _losses(full)


def test_bad_sampling_flag_is_one_line(capsys, tmp_path):
    assert main(FLAGS + ["--sampling", "shuffled", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sampling" in err[0] and "invalid choice" in err[0], err
    assert not (tmp_path / "x").exists()
