"""Checkpoint format, kill-safety and detection of damaged or mismatched checkpoints."""
import json
import os

import pytest
import torch

from asyncpp_ext.training import checkpoint as ckpt
from asyncpp_ext.training.checkpoint import (CheckpointError, check_resume_config, latest_checkpoint,
                                    list_checkpoints, load_checkpoint, save_checkpoint)
from asyncpp_ext.training.config import RunConfig


def _state(value):
    return {"params": {"embed.tok.weight": torch.full((3, 2), float(value))},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": ["embed.tok.weight"]}]}}


def _meta(step):
    return {"config": RunConfig().to_dict(), "data": {"seed": 0, "position": step}}


def test_round_trip_and_layout(tmp_path):
    path = save_checkpoint(tmp_path, 7, [_state(1), _state(2)], _meta(7))
    assert path.name == "ckpt-000007"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "stage-00.pt", "stage-01.pt"]
    meta, shards = load_checkpoint(path)
    assert meta["step"] == 7 and meta["data"]["position"] == 7
    assert set(meta["shards"]["stage-00.pt"]) == {"bytes", "sha256"}
    assert [s["stage"] for s in shards] == [0, 1]
    assert torch.equal(shards[1]["engine"]["params"]["embed.tok.weight"], torch.full((3, 2), 2.0))
    assert isinstance(shards[0]["rng"]["torch"], torch.Tensor)
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_rng_state_round_trip():
    import random

    state = ckpt.capture_rng_state()
    a = (torch.rand(3), random.random())
    ckpt.restore_rng_state(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_crash_between_temp_write_and_rename_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 10, [_state(1)], _meta(10))

    def killed(src, dst):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ckpt.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 20, [_state(2)], _meta(20))
    monkeypatch.undo()
    assert (tmp_path / ".tmp-ckpt-000020" / "stage-00.pt").exists()  # the half-finished write
    assert latest_checkpoint(tmp_path).name == "ckpt-000010"
    meta, shards = load_checkpoint(latest_checkpoint(tmp_path))
    assert meta["step"] == 10
    # The next attempt at the same step cleans the leftover and completes.
    save_checkpoint(tmp_path, 20, [_state(2)], _meta(20))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 20]
    assert not (tmp_path / ".tmp-ckpt-000020").exists()


def test_rewriting_the_same_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 5, [_state(1)], _meta(5))
    save_checkpoint(tmp_path, 5, [_state(3)], _meta(5))
    _, shards = load_checkpoint(tmp_path / "ckpt-000005")
    assert shards[0]["engine"]["params"]["embed.tok.weight"][0, 0] == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000005"]


@pytest.fixture
def saved(tmp_path):
    return save_checkpoint(tmp_path, 3, [_state(1)], _meta(3))


def test_truncated_shard_is_detected(saved):
    shard = saved / "stage-00.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"stage-00.pt is truncated \(\d+ bytes, \d+ expected\)"):
        load_checkpoint(saved)


def test_corrupted_shard_is_detected(saved):
    shard = saved / "stage-00.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"stage-00.pt is corrupted \(its checksum differs from "
                                              r"meta.json's\)"):  # same size: the sizes are not the news
        load_checkpoint(saved)


def test_unloadable_shard_with_matching_checksum_is_reported(saved):
    shard = saved / "stage-00.pt"
    shard.write_bytes(b"not a torch file")
    meta = json.loads((saved / "meta.json").read_text())
    meta["shards"]["stage-00.pt"] = {"bytes": shard.stat().st_size, "sha256": ckpt._sha256(shard)}
    (saved / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(saved)


@pytest.mark.parametrize("damage, match", [
    (lambda d: os.remove(d / "meta.json"), "no meta.json"),
    (lambda d: (d / "meta.json").write_text("{trunc"), "unreadable or corrupted"),
    (lambda d: os.remove(d / "stage-00.pt"), "is missing"),
    (lambda d: (d / "meta.json").write_text(json.dumps({**json.loads((d / "meta.json").read_text()), "step": -3})),
     "has step=-3, below 0; the checkpoint is damaged"),
])
def test_missing_or_broken_files_are_detected(saved, damage, match):
    damage(saved)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(saved)


def test_no_checkpoint_in_directory(tmp_path):
    (tmp_path / ".tmp-ckpt-000001").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        latest_checkpoint(tmp_path)


def test_config_mismatch_names_the_field(tmp_path):
    saved_cfg = RunConfig().to_dict()
    run = RunConfig()
    run.pipeline.stages = 2  # re-splitting is allowed
    run.train.steps = 999
    check_resume_config(tmp_path, saved_cfg, run)
    run.model = run.model.__class__(**{**saved_cfg["model"], "n_embd": 64})
    with pytest.raises(CheckpointError, match="model.n_embd=32 but this run has 64"):
        check_resume_config(tmp_path, saved_cfg, run)
    run = RunConfig()
    run.pipeline.schedule = "sync"
    with pytest.raises(CheckpointError, match="pipeline.schedule='2bw'"):
        check_resume_config(tmp_path, saved_cfg, run)


def test_auto_precisions_are_compared_as_what_they_ran_at(tmp_path):
    """"auto" is bf16 on cuda and fp32 on cpu (autocast, and Muon's Newton-Schulz): a cpu checkpoint
    resumes with --dtype/--ns-dtype fp32 but not as "auto" on cuda, which would change the numbers."""
    saved = RunConfig()
    saved.optim.name = "muon"
    saved_cfg = saved.to_dict()

    def run(device, dtype="auto", ns_dtype="auto", optimizer="muon"):
        cfg = RunConfig.from_dict(saved_cfg)
        cfg.train.device, cfg.train.dtype, cfg.optim.ns_dtype, cfg.optim.name = device, dtype, ns_dtype, optimizer
        return cfg

    check_resume_config(tmp_path, saved_cfg, run("cpu", "fp32", "fp32"))
    check_resume_config(tmp_path, saved_cfg, run("cuda", "fp32", "fp32"))
    with pytest.raises(CheckpointError, match=r"train.dtype='auto' \(fp32 on cpu\) but this run has 'auto' "
                                              r"\(bf16 on cuda\); pass --dtype fp32"):
        check_resume_config(tmp_path, saved_cfg, run("cuda", ns_dtype="fp32"))
    with pytest.raises(CheckpointError, match=r"optim.ns_dtype='auto' \(fp32 on cpu\) .*pass --ns-dtype fp32"):
        check_resume_config(tmp_path, saved_cfg, run("cuda", "fp32"))
    with pytest.raises(CheckpointError, match=r"train.dtype='auto' \(fp32 on cpu\) but this run has 'bf16'"):
        check_resume_config(tmp_path, saved_cfg, run("cpu", "bf16"))
    saved.optim.name = "adamw"  # no Newton-Schulz: its "auto" means nothing on either device
    saved_cfg = saved.to_dict()
    check_resume_config(tmp_path, saved_cfg, run("cuda", "fp32", optimizer="adamw"))


def test_cuda_generator_states_of_a_machine_with_more_gpus_restore_on_the_devices_present(monkeypatch):
    """A checkpoint written where two GPUs were visible, resumed where one is: that one's state is
    restored (torch's set_rng_state_all would ask for a device that does not exist)."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state)))
    state = {"torch": torch.get_rng_state(), "python": [3, [0] * 625, None],
             "cuda": [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]}
    import random
    before = random.getstate()
    try:
        ckpt.restore_rng_state(state)
    finally:
        random.setstate(before)
    assert [(d, int(s[0])) for d, s in restored] == [(0, 0)]
