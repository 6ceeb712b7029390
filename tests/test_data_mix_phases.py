"""``--change-data-mix``: a resume may switch a run to another mixture (an annealing phase). The new
mixture counts its shares from the checkpoint's step, sources in both phases continue their window
order, a resume inside the new phase continues it exactly, and the same mixture with the flag is
the run it was."""
import json

import numpy as np
import pytest

from asyncpp_ext.data import BatchStream, DataError
from asyncpp_ext.data.mixture import MixtureStream
from asyncpp_ext.training.cli import main as train

RANGES = {"a": (0, 50), "b": (100, 150), "c": (200, 250)}
SEQ, MB, B = 8, 2, 4  # 8 windows per minibatch
TOKENS = {name: np.random.default_rng(j).integers(*RANGES[name], size=size).astype(np.uint16)
          for j, (name, size) in enumerate((("a", 3000), ("b", 2001), ("c", 1500)))}


def _mixture(weights, change=False, sampling="epoch"):
    parts = [BatchStream(TOKENS[name], MB, B, SEQ, seed=5, sampling=sampling)
             for name in weights]
    return MixtureStream(parts, list(weights.values()), names=list(weights), change=change)


def _windows(stream, steps):
    """(source, window) of every window the next ``steps`` minibatches hold."""
    seen = []
    for _ in range(steps):
        for inputs, _ in stream.next():
            for row in inputs.tolist():
                seen.append((next(n for n, (lo, hi) in RANGES.items() if lo <= row[0] < hi), tuple(row)))
    return seen


def _switched(first, second, at, change=True):
    old = _mixture(first)
    _windows(old, at)
    new = _mixture(second, change=change)
    new.load_state_dict(json.loads(json.dumps(old.state_dict())))
    return old, new


def test_the_new_mixture_counts_its_shares_from_the_switch():
    _, new = _switched({"a": 3, "b": 1}, {"a": 1, "b": 1, "c": 2}, at=5)
    labels = [s for s, _ in _windows(new, 10)]
    assert [labels.count(n) for n in "abc"] == [20, 20, 40]  # 80 windows at exactly 1 : 1 : 2
    assert new.position == 15 and new.state_dict()["phase_start"] == 5


def test_a_source_in_both_phases_continues_its_window_order():
    old, new = _switched({"a": 3, "b": 1}, {"b": 3, "a": 1}, at=5)
    before = [w for s, w in _windows(_mixture({"a": 3, "b": 1}), 5) if s == "b"]
    after = [w for s, w in _windows(new, 10) if s == "b"]
    assert len(before) == 10 and len(after) == 60
    assert not set(before) & set(after)  # source b has 250 windows: none repeats across the switch
    assert len(set(before + after)) == 70


def test_a_resume_inside_the_new_phase_continues_it_exactly():
    _, straight = _switched({"a": 3, "b": 1}, {"a": 1, "c": 1}, at=4)
    _, new = _switched({"a": 3, "b": 1}, {"a": 1, "c": 1}, at=4)
    _windows(new, 3)
    state = json.loads(json.dumps(new.state_dict()))
    resumed = _mixture({"a": 1, "c": 1})  # no flag needed: the mixture is the state's
    resumed.load_state_dict(state)
    assert _windows(straight, 3) and _windows(straight, 4) == _windows(resumed, 4)
    assert resumed.state_dict()["history"] == state["history"]


def test_the_same_mixture_with_the_flag_is_the_run_it_was():
    plain = _mixture({"a": 3, "b": 1})
    _windows(plain, 5)
    _, same = _switched({"a": 3, "b": 1}, {"a": 3, "b": 1}, at=5)
    assert _windows(same, 4) == _windows(plain, 4)
    assert "history" not in same.state_dict()


def test_without_the_flag_another_mixture_is_refused_naming_it():
    with pytest.raises(DataError, match="weights 0.75, 0.25 .* or pass --change-data-mix"):
        _switched({"a": 3, "b": 1}, {"a": 1, "b": 1}, at=2, change=False)
    with pytest.raises(DataError, match="belongs to an earlier mixture"):
        _switched({"a": 3, "b": 1}, {"a": 1, "b": 1}, at=2)[1].minibatch(1)


COMMON = ["--model", "tiny", "--no-progress", "--threads", "1", "--seq-len", "16", "--micro-batch-size", "2",
          "--microbatches", "4", "--eval-every", "0", "--ckpt-every", "3"]


@pytest.fixture
def texts(tmp_path):
    rng = np.random.default_rng(0)
    for name, chars, n in (("web", "abcdefghij ", 6000), ("code", "(){};=+0123", 3000), ("math", "0123456789+=", 3000)):
        (tmp_path / f"{name}.txt").write_text("".join(rng.choice(list(chars), size=n)))
    return {name: f"{tmp_path / name}.txt" for name in ("web", "code", "math")}


def _mix(texts, **weights):
    return [flag for name, w in weights.items() for flag in ("--data-mix", f"{texts[name]}={w}")]


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_pipeline_switches_as_its_simulation_does_and_resumes_in_the_new_phase(tmp_path, texts, capsys):
    runs, anneal = {}, _mix(texts, web=1, math=1)
    for name, flags, ends in (("sim", ["--simulate"], [9]), ("pipe", ["--stages", "2", "--timeout", "30"], [6, 9])):
        run = runs[name] = tmp_path / name
        assert train([*COMMON, *flags, *_mix(texts, web=3, code=1), "--steps", "3", "--out", str(run)]) == 0
        assert train(["--resume", str(run), "--no-progress", "--steps", str(ends[0]), *anneal,
                      "--change-data-mix"]) == 0
        for end in ends[1:]:  # from ckpt-000006, inside the new phase, without the flag
            capsys.readouterr()
            assert train(["--resume", str(run), "--no-progress", "--steps", str(end)]) == 0
            assert capsys.readouterr().err.strip().endswith("changed: train.steps 6->9")  # nothing about the mix
    switched = _losses(runs["sim"])
    assert _losses(runs["pipe"]) == switched and len(switched) == 9
    # the new phase differs from never switching
    never = tmp_path / "never"
    assert train([*COMMON, "--simulate", *_mix(texts, web=3, code=1), "--steps", "9", "--out", str(never)]) == 0
    assert _losses(never)[:3] == _losses(runs["sim"])[:3] and _losses(never)[3:] != _losses(runs["sim"])[3:9]


def test_the_flag_without_a_mixture_is_one_line(tmp_path, texts, capsys):
    assert train([*COMMON, "--simulate", "--data", texts["web"], "--change-data-mix", "--steps", "2",
                  "--out", str(tmp_path / "r")]) == 2
    assert "--change-data-mix changes a --data-mix mixture" in capsys.readouterr().err
