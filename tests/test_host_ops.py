"""bench/host_ops.py: what it counts in a trace (here on made-up events), and a small run of its
rows end to end (slow: each row compiles)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import host_ops  # noqa: E402


def _op(name, ts, dur, tid=1):
    return dict(ph="X", cat="cpu_op", name=name, ts=ts, dur=dur, tid=tid)


def test_counts_the_innermost_compute_operations_per_step():
    events = [
        _op("TorchDynamo Cache Lookup", 0, 5),
        _op("aten::linear", 10, 50), _op("aten::t", 11, 2), _op("aten::addmm", 14, 40),  # addmm, not linear
        _op("aten::view", 15, 1),  # inside addmm: a view holds no launch, addmm stays innermost
        _op("graph_0_cpp_fused_add_0", 70, 10),
        _op("aten::empty", 90, 1), _op("aten::reshape", 95, 3), _op("aten::_reshape_alias", 96, 1),
        _op("aten::add_", 0, 4, tid=2),  # another thread (autograd's) counts too
        dict(ph="X", cat="python_function", name="aten::mm", ts=200, dur=5, tid=1),  # not an operator event
    ]
    got = host_ops.count_trace(events, steps=2)
    assert got["ops_per_step"] == 1.5  # addmm, the fused kernel, add_: 3 over 2 steps
    assert got["compiled_calls_per_step"] == 0.5
    assert dict(got["top"]) == {"aten::addmm": 0.5, "graph_0_cpp_fused_add_0": 0.5, "aten::add_": 0.5}


def test_bad_inputs_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        host_ops.parse_args(["--rows", "ours-block,nope"])
    assert exc.value.code == 2 and ("--rows: nope; choose from ours-block, ours-stage, ours-block-fusion, hf"
                                    in capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:  # the fused weight gradients need bf16 compute copies
        host_ops.parse_args(["--rows", "ours-block,ours-block-fusion"])
    assert exc.value.code == 2 and "--rows ours-block-fusion: the fused weight gradients need bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_ops.parse_args(["--steps", "6", "--trace", "3"])
    assert "--trace 3: trace 1 to a third of --steps (2) steps" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be a positive integer, got 0"),
    (["--heads", "0"], "--heads must be a positive integer, got 0"),
    (["--width", "33"], "--heads=9 must divide --width=33"),
    (["--heads", "4", "--width", "72", "--kv-heads", "3"], "--kv-heads=3 must divide --heads=4"),
    (["--mlp", "0"], "--mlp must be a positive integer, got 0"),
    (["--vocab", "10"], "--vocab 10 is below 256"),
])
def test_a_bad_model_shape_names_its_flag_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        host_ops.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_json_is_stdout_alone(capsys, monkeypatch):
    """A run's own lines (the training command's progress) go to stderr under --json."""
    def run(args):
        print("a line of the run")
        return {}

    monkeypatch.setattr(host_ops, "run", run)
    assert host_ops.main(["--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == {} and err == "a line of the run\n"


def test_the_default_rows_are_those_that_run_at_the_dtype():
    assert host_ops.parse_args([]).rows == ["ours-block", "ours-stage", "hf"]
    assert host_ops.parse_args(["--dtype", "bf16"]).rows == ["ours-block", "ours-stage", "ours-block-fusion", "hf"]


@pytest.mark.slow
def test_a_small_run_counts_one_compiled_call_per_block_region_or_model():
    # 2 layers, 2 microbatches: block scope calls the embedding, 2 layers and the head per
    # microbatch (8 a step), stage scope the region and the head (4), the compiled Hugging Face
    # model one call per microbatch (2); both scopes train the same numbers.
    pytest.importorskip("transformers")
    rows = host_ops.run(host_ops.parse_args(["--layers", "2", "--width", "36", "--steps", "6", "--trace", "2",
                                             "--microbatches", "2"]))
    assert {r: rows[r]["compiled_calls_per_step"] for r in rows} == {"ours-block": 8, "ours-stage": 4, "hf": 2}
    assert all(rows[r]["ops_per_step"] > 0 and rows[r]["ms_per_step"] > 0 for r in rows)
    assert rows["ours-block"]["losses"] == pytest.approx(rows["ours-stage"]["losses"], rel=1e-5)
    assert rows["ours-stage"]["ops_per_step"] < rows["ours-block"]["ops_per_step"]  # fused across blocks
