"""``--data-mix PATH=WEIGHT``: a weighted mixture of token sources. Each minibatch takes each
source's share of its windows to within a window, the draw is a pure function of (seed, position) so a
resume continues it, the sources mix within microbatches, each source holds out its own end, and
a pipeline trains on exactly what its simulation trains on."""
import json
import math

import numpy as np
import pytest

from asyncpp_ext.data import BatchStream, DataError
from asyncpp_ext.data.mixture import (MixtureStream, check_fits, mixture_eval_batches, proportional,
                                      windows_before)
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.eval import main as evaluate

# Three sources whose ids cannot be confused: a window's first id says where it came from.
RANGES = {"a": (0, 50), "b": (100, 150), "c": (200, 250)}
SEQ, MB, B = 8, 2, 8  # 16 windows per minibatch


def _tokens(name, n, seed=0):
    low, high = RANGES[name]
    return np.random.default_rng(seed).integers(low, high, size=n).astype(np.uint16)


def _source_of(window):
    for name, (low, high) in RANGES.items():
        if low <= int(window[0]) < high:
            assert all(low <= int(t) < high for t in window), "a window crosses sources"
            return name
    raise AssertionError(window)


def _mixture(weights, sampling="random", sizes=(5000, 3000, 2000), seed=3):
    names = list(weights)
    parts = [BatchStream(_tokens(n, size, j), MB, B, SEQ, seed=seed, sampling=sampling)
             for j, (n, size) in enumerate(zip(names, sizes))]
    return MixtureStream(parts, list(weights.values()), names=names)


def _sources(minibatch):
    return [[_source_of(row) for row in inputs] for inputs, _ in minibatch]


def test_each_prefix_of_the_run_holds_every_source_by_its_weight_to_within_half_a_window():
    weights = [0.6, 0.3, 0.1]
    previous = [0, 0, 0]
    for n in range(0, 2000, 7):
        counts = windows_before(weights, n)
        assert sum(counts) == n
        assert all(abs(c - n * w) <= 0.5 + 1e-9 for c, w in zip(counts[1:], weights[1:]))
        assert abs(counts[0] - n * weights[0]) <= 1 + 1e-9  # the heaviest: half a window per other source
        assert all(c >= p for c, p in zip(counts, previous))  # no source ever gives a window back
        previous = counts


def test_every_minibatch_takes_its_counts_from_the_right_sources_mixed_within_microbatches():
    stream = _mixture({"a": 5, "b": 2, "c": 1})  # 0.625 / 0.25 / 0.125 of 16 windows
    seen = {"a": 0, "b": 0, "c": 0}
    mixed = 0
    for position in range(40):
        labels = _sources(stream.next())
        flat = [s for mb in labels for s in mb]
        assert [flat.count(n) for n in "abc"] == stream.counts(position)
        mixed += sum(len(set(mb)) > 1 for mb in labels)
        for name in "abc":
            seen[name] += flat.count(name)
    assert seen == {"a": 400, "b": 160, "c": 80}  # 640 windows at exactly 5 : 2 : 1
    assert mixed >= 60  # of 80 microbatches: the windows are shuffled across them, not grouped


def test_the_draw_is_a_pure_function_of_seed_and_position_and_resumes():
    stream = _mixture({"a": 3, "b": 1, "c": 1}, sampling="epoch")
    for _ in range(5):
        stream.next()
    state = stream.state_dict()
    ahead = [stream.next() for _ in range(3)]
    again = _mixture({"a": 3, "b": 1, "c": 1}, sampling="epoch")
    again.load_state_dict(json.loads(json.dumps(state)))
    for want in ahead:
        got = again.next()
        assert all(np.array_equal(x, y) for (x, _), (y, _) in zip(want, got))
    fresh = _mixture({"a": 3, "b": 1, "c": 1}, sampling="epoch")
    assert all(np.array_equal(x, y) for (x, _), (y, _) in zip(fresh.minibatch(6), ahead[1]))


def test_in_epoch_order_no_window_of_a_source_repeats_before_its_epoch_ends():
    stream = _mixture({"a": 1, "b": 1, "c": 2}, sampling="epoch", sizes=(801, 2001, 3001))
    per_source = {"a": [], "b": [], "c": []}
    for _ in range(30):
        for inputs, _ in stream.next():
            for row in inputs:
                per_source[_source_of(row)].append(tuple(row.tolist()))
    a, b = per_source["a"], per_source["b"]
    assert len(a) == 30 * 4 and len(set(a[:100])) == 100  # source a has 100 windows: all, then again
    assert set(a[100:]) <= set(a[:100])
    assert len(set(b)) == len(b) == 120  # source b has 250 windows: none twice yet


def test_a_resume_with_other_weights_or_data_is_refused():
    stream = _mixture({"a": 3, "b": 1, "c": 1})
    stream.next()
    state = stream.state_dict()
    with pytest.raises(DataError, match="weights 0.6, 0.2, 0.2 .*this run 3 with 0.4, 0.4, 0.2"):
        _mixture({"a": 2, "b": 2, "c": 1}).load_state_dict(state)
    with pytest.raises(DataError, match="--data-mix source b: the checkpoint's data stream ran over 3000 training tokens"):
        _mixture({"a": 3, "b": 1, "c": 1}, sizes=(5000, 3100, 2000)).load_state_dict(state)
    with pytest.raises(DataError, match="trained on a --data-mix mixture, this run on one --data"):
        BatchStream(_tokens("a", 1000), MB, B, SEQ, seed=3).load_state_dict(state)
    plain = BatchStream(_tokens("a", 1000), MB, B, SEQ, seed=3).state_dict()
    with pytest.raises(DataError, match="trained on one --data source, this run on a --data-mix"):
        _mixture({"a": 3, "b": 1, "c": 1}).load_state_dict(plain)


def test_too_many_sources_for_a_minibatch_are_refused():
    check_fits([0.5, 0.5], 1, ["a", "b"])  # two sources always fit
    check_fits([0.4, 0.3, 0.3], 3, ["a", "b", "c"])
    with pytest.raises(DataError, match="4 sources a, b, c, d may need 3 windows in one minibatch of 2"):
        check_fits([0.25] * 4, 2, ["a", "b", "c", "d"])
    assert windows_before([0.25] * 4, 2) == [-1, 1, 1, 1]  # what it refuses: a source owing a window


def test_the_held_out_set_mixes_each_sources_end_by_the_weights():
    assert proportional([0.5, 0.3, 0.2], 7) == [4, 2, 1]
    assert sum(proportional([0.61, 0.29, 0.1], 33)) == 33
    held = [_tokens(n, 400, j) for j, n in enumerate("abc")]
    batches = mixture_eval_batches(held, [5, 2, 1], 8, SEQ, 2)
    labels = [s for inputs, _ in batches for s in (_source_of(r) for r in inputs)]
    assert [labels.count(n) for n in "abc"] == [10, 4, 2]
    assert batches[0][0].shape == (8, SEQ)
    windows = 3 * (400 - SEQ)  # one pass: 3 parts of 400 - SEQ distinct windows each
    assert len(mixture_eval_batches(held, [5, 2, 1], 8, SEQ, windows // 8)) == windows // 8
    with pytest.raises(DataError, match=f"--batches {windows // 8 + 1} needs .* {windows} distinct ones; pass "
                                        f"--batches {windows // 8} or fewer$"):
        mixture_eval_batches(held, [5, 2, 1], 8, SEQ, windows // 8 + 1, count_flag="--batches")


# ---- the command -------------------------------------------------------------------------
COMMON = ["--model", "tiny", "--no-progress", "--threads", "1", "--seq-len", "16", "--micro-batch-size", "2",
          "--microbatches", "4", "--eval-every", "3", "--eval-batches", "2"]


@pytest.fixture
def texts(tmp_path):
    rng = np.random.default_rng(0)
    letters = "".join(rng.choice(list("abcdefghij "), size=6000))
    digits = "".join(rng.choice(list("0123456789+="), size=3000))
    (tmp_path / "letters.txt").write_text(letters)
    (tmp_path / "digits.txt").write_text(digits)
    (tmp_path / "signs.txt").write_text("".join(rng.choice(list("+-*/()"), size=3000)))
    return [f"{tmp_path / 'letters.txt'}=3", f"{tmp_path / 'digits.txt'}=1"]


def _mix(texts):
    return [flag for spec in texts for flag in ("--data-mix", spec)]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_pipeline_trains_on_the_mixture_its_simulation_trains_on_and_resumes(tmp_path, texts):
    sim, real, resumed = tmp_path / "sim", tmp_path / "real", tmp_path / "resumed"
    assert train([*COMMON, *_mix(texts), "--simulate", "--steps", "6", "--out", str(sim)]) == 0
    pipeline = [*COMMON, *_mix(texts), "--stages", "2", "--timeout", "30"]
    assert train([*pipeline, "--steps", "6", "--out", str(real)]) == 0
    assert [r["loss"] for r in _rows(real)] == [r["loss"] for r in _rows(sim)]
    assert train([*pipeline, "--steps", "3", "--ckpt-every", "3", "--out", str(resumed)]) == 0
    assert train(["--resume", str(resumed), "--steps", "6", "--no-progress"]) == 0
    assert [r["loss"] for r in _rows(resumed)] == [r["loss"] for r in _rows(sim)]
    saved = json.loads((real / "config.json").read_text())["data"]["mix"]
    assert [w for _, w in saved] == [3.0, 1.0]


def test_the_mixture_is_not_either_source_alone(tmp_path, texts):
    runs = {}
    for name, flags in (("mix", _mix(texts)), ("letters", ["--data", texts[0].rsplit("=", 1)[0]])):
        runs[name] = tmp_path / name
        assert train([*COMMON, *flags, "--simulate", "--steps", "3", "--out", str(runs[name])]) == 0
    assert [r["loss"] for r in _rows(runs["mix"])] != [r["loss"] for r in _rows(runs["letters"])]


def test_asyncpp_eval_scores_the_runs_own_mixed_held_out_set(tmp_path, texts, capsys):
    run = tmp_path / "run"
    assert train([*COMMON, *_mix(texts), "--simulate", "--steps", "3", "--out", str(run)]) == 0
    capsys.readouterr()
    assert evaluate([str(run), "--json", str(tmp_path / "eval.json")]) == 0
    row = json.loads((tmp_path / "eval.json").read_text())
    row = row[0] if isinstance(row, list) else row
    logged = [r["eval_loss"] for r in _rows(run) if "eval_loss" in r][-1]
    assert math.isclose(row["loss"], logged, rel_tol=1e-5)
    assert "each --data-mix source" in capsys.readouterr().out


@pytest.mark.parametrize("flags, words", [
    (["--data-mix", "{tmp}/letters.txt"], "is not PATH=WEIGHT with a weight > 0"),
    (["--data-mix", "{tmp}/letters.txt=0"], "is not PATH=WEIGHT with a weight > 0"),
    (["--data-mix", "{tmp}/letters.txt=-1"], "is not PATH=WEIGHT with a weight > 0"),
    (["--data-mix", "{tmp}/letters.txt=nan"], "is not PATH=WEIGHT with a weight > 0"),
    (["--data-mix", "{tmp}/letters.txt=1", "--data", "{tmp}/digits.txt"], "give --data or --data-mix, not both"),
    (["--data-mix", "{tmp}/letters.txt=1", "--data-mix", "{tmp}/letters.txt=2"], "names {tmp}/letters.txt twice"),
    (["--data-mix", "{tmp}/letters.txt=1", "--data-mix", "{tmp}/none.txt=1"], "none.txt"),
    (["--data-mix", "{tmp}/letters.txt=1", "--data-mix", "{tmp}/digits.txt=1", "--data-mix", "{tmp}/signs.txt=1",
      "--microbatches", "1", "--micro-batch-size", "1"], "may need 2 windows in one minibatch of 1"),
    # past one pass over the held-out parts' windows, as one --data source's eval split refuses
    (["--data-mix", "{tmp}/letters.txt=3", "--data-mix", "{tmp}/digits.txt=1", "--eval-batches", "1000"],
     "--eval-batches 1000 needs 2000 windows but the --data-mix sources' held-out parts have"),
])
def test_bad_mixtures_are_one_line_and_write_nothing(tmp_path, texts, capsys, flags, words):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    out = tmp_path / "out"
    assert train([*COMMON, "--simulate", "--steps", "2", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.replace("{tmp}", str(tmp_path)) in err[0], err
    assert not out.exists()


def _mixture_per_rank(differ: bool) -> None:
    import torch.distributed as dist
    from asyncpp_ext.pipeline import init_distributed
    from asyncpp_ext.training.distributed import check_same_data

    init_distributed(30)
    light = _tokens("b", 3000, 1)
    if differ and dist.get_rank() == 1:
        light[1500] += 1  # this rank's copy of the light source differs in one token
    parts = [BatchStream(tokens, MB, B, SEQ, seed=0)
             for tokens in (_tokens("a", 5000), light)]
    check_same_data(MixtureStream(parts, [3, 1]))


@pytest.mark.multiproc
def test_ranks_reading_another_copy_of_a_source_are_stopped_at_start():
    from asyncpp_ext.pipeline import LaunchError, spawn

    spawn(_mixture_per_rank, 2, (False,))
    with pytest.raises(LaunchError, match=r"rank 1 reads other training data than rank 0 .* every rank must "
                                          r"read the same --data or --data-mix"):
        spawn(_mixture_per_rank, 2, (True,))


def test_a_resume_under_other_weights_is_one_line_and_changes_nothing(tmp_path, texts, capsys):
    run = tmp_path / "run"
    pipeline = [*COMMON, *_mix(texts), "--stages", "2", "--timeout", "30"]
    assert train([*pipeline, "--steps", "2", "--ckpt-every", "2", "--out", str(run)]) == 0
    before = {p.name: p.read_bytes() for p in (run / "config.json", run / "metrics.jsonl")}
    capsys.readouterr()
    other = [texts[0].replace("=3", "=1"), texts[1]]
    assert train(["--resume", str(run), "--steps", "4", "--no-progress", *_mix(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights 0.75, 0.25 (normalised), this run 2 with 0.5, 0.5" in err[0], err
    assert {p.name: p.read_bytes() for p in (run / "config.json", run / "metrics.jsonl")} == before
    moved = tmp_path / "moved.txt"  # the same data at another path resumes
    moved.write_bytes((tmp_path / "letters.txt").read_bytes())
    assert train(["--resume", str(run), "--steps", "4", "--no-progress",
                  *_mix([f"{moved}=3", texts[1]])]) == 0


def test_the_plan_line_gives_each_sources_share_tokens_and_epochs(tmp_path, texts, capsys):
    stream = _mixture({"a": 5, "b": 2, "c": 1})  # 400 : 160 : 80 windows of 8 tokens in 40 steps
    assert stream.plan(40) == ("--data-mix to step 40: a 62% (5,000 tokens, 0.64 epochs), "
                               "b 25% (3,000 tokens, 0.43 epochs), c 12% (2,000 tokens, 0.32 epochs)")
    for flags in (["--simulate"], ["--stages", "2", "--timeout", "30"]):
        out = tmp_path / flags[0].strip("-")
        assert train([*COMMON, *_mix(texts), *flags, "--steps", "2", "--out", str(out)]) == 0
        lines = [line for line in capsys.readouterr().err.splitlines() if "--data-mix to step 2" in line]
        assert len(lines) == 1 and "letters.txt 75%" in lines[0] and "digits.txt 25%" in lines[0], lines
