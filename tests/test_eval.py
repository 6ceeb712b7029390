"""``asyncpp-eval``: a checkpoint's held-out loss equals the ``eval_loss`` its run logged at that
step (one process and a 2-stage pipeline, the held-out end of --data and a --val-data file); runs
compared on one --data see the same windows; bad inputs give one line and exit 2."""
import json
import math

import pytest

from asyncpp_ext.data import builtin_corpus
from asyncpp_ext.training import evaluation as ev
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.run_files import read_metrics
from bpe_tokenizer import train_bpe

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
FLAGS = ["--model", "tiny", "--seq-len", "32", "--steps", "4", "--no-progress", "--eval-every", "2",
         "--ckpt-every", "2", "--eval-batches", "3"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A training and a validation text file (UTF-8 bytes)."""
    root = tmp_path_factory.mktemp("eval_texts")
    corpus = bytes(builtin_corpus()[:120_000])
    (root / "train.txt").write_bytes(corpus[:100_000])
    (root / "val.txt").write_bytes(corpus[100_000:])
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, texts):
    """2bw Muon in one process on the built-in corpus; the same as a 2-stage pipeline; sync and 2bw
    with --val-data."""
    root = tmp_path_factory.mktemp("eval_runs")
    val = ["--data", str(texts / "train.txt"), "--val-data", str(texts / "val.txt")]
    plans = {"sim": ["--simulate", "--optimizer", "muon"], "pipe": ["--stages", "2", "--optimizer", "muon"],
             "val-sync": ["--simulate", "--schedule", "sync", *val], "val-2bw": ["--simulate", *val],
             "val-mb4": ["--simulate", "--micro-batch-size", "4", *val]}
    for name, flags in plans.items():
        assert train([*FLAGS, *flags, "--out", str(root / name)]) == 0
    return root


def _eval(argv, capsys):
    rc = ev.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def _logged(run_dir) -> dict:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r}


@pytest.mark.parametrize("name", ["sim", "pipe", "val-sync", "val-2bw"])
def test_every_checkpoints_loss_is_the_eval_loss_its_run_logged(runs, name, tmp_path, capsys):
    rc, lines, err = _eval([runs / name, "--every-checkpoint", "--json", tmp_path / "rows.json"], capsys)
    assert rc == 0, err
    rows = json.loads((tmp_path / "rows.json").read_text())
    logged = _logged(runs / name)
    assert [r["step"] for r in rows] == [2, 4] == sorted(logged)
    for row in rows:
        assert row["loss"] == pytest.approx(logged[row["step"]], rel=1e-6, abs=0)
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
        assert row["bits_per_byte"] == pytest.approx(row["loss"] / math.log(2))
        assert row["tokens"] == 3 * 8 * 32  # --eval-batches 3 of the tiny preset's 8 x 32 tokens
    assert len(lines) == 4 and lines[1].split()[1:3] == ["2", f"{rows[0]['loss']:.4f}"]


def test_the_latest_checkpoint_alone_by_default(runs, capsys):
    rc, lines, _ = _eval([runs / "sim"], capsys)
    assert rc == 0 and len(lines) == 3 and lines[1].split()[1] == "4"
    assert lines[2] == "data: the held-out 0.1 of builtin; on cpu in fp32"  # --dtype auto on the cpu


def test_runs_compared_on_one_file_see_the_same_windows(runs, texts, tmp_path, capsys):
    """--data the runs' own --val-data file: each row is the run's logged eval_loss, and the data line
    names the file once."""
    rc, lines, err = _eval([runs / "val-sync", runs / "val-2bw", "--data", texts / "val.txt", "--json",
                            tmp_path / "rows.json"], capsys)
    assert rc == 0, err
    rows = json.loads((tmp_path / "rows.json").read_text())
    for row, name in zip(rows, ["val-sync", "val-2bw"]):
        assert row["loss"] == pytest.approx(_logged(runs / name)[4], rel=1e-6, abs=0)
    assert rows[0]["loss"] != rows[1]["loss"] and lines[-1] == f"data: {texts / 'val.txt'}; on cpu in fp32"
    rc, lines, _ = _eval([runs / "sim", runs / "val-2bw"], capsys)
    assert rc == 0 and lines[-1].startswith("data: each run's own evaluation set")


def test_runs_of_other_evaluation_sizes_are_scored_on_the_first_runs_windows(runs, texts, tmp_path, capsys):
    """val-mb4 evaluated 3 batches of 4 windows, val-2bw 3 of 8: on one --data file both are scored on
    the first run's 3 x 8 (its logged eval_loss), then on val-mb4's 3 x 4 when it comes first."""
    for order, size in ((["val-2bw", "val-mb4"], 8), (["val-mb4", "val-2bw"], 4)):
        rc, _, err = _eval([*(runs / name for name in order), "--data", texts / "val.txt", "--json",
                            tmp_path / "rows.json"], capsys)
        assert rc == 0, err
        rows = json.loads((tmp_path / "rows.json").read_text())
        assert [r["tokens"] for r in rows] == [3 * size * 32] * 2
        assert rows[0]["loss"] == pytest.approx(_logged(runs / order[0])[4], rel=1e-6, abs=0)
        assert rows[1]["loss"] != pytest.approx(_logged(runs / order[1])[4], rel=1e-6, abs=0)


def test_each_data_file_gives_each_checkpoint_a_row(runs, texts, tmp_path, capsys):
    """--data twice: a row per checkpoint and file, each naming its file; the run's own held-out
    file's row is its logged eval_loss."""
    train_txt, val_txt = texts / "train.txt", texts / "val.txt"
    rc, lines, err = _eval([runs / "val-2bw", "--every-checkpoint", "--data", train_txt, "--data", val_txt,
                            "--json", tmp_path / "rows.json"], capsys)
    assert rc == 0, err
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["step"], r["data"]) for r in rows] == [(2, str(train_txt)), (2, str(val_txt)),
                                                      (4, str(train_txt)), (4, str(val_txt))]
    logged = _logged(runs / "val-2bw")
    for row in rows[1::2]:
        assert row["loss"] == pytest.approx(logged[row["step"]], rel=1e-6, abs=0)
    assert rows[0]["loss"] != rows[1]["loss"]
    assert lines[0].endswith("  data") and lines[1].endswith(f"  {train_txt}") and lines[2].endswith(f"  {val_txt}")
    assert lines[-1] == "data: each row's column; on cpu in fp32"


def test_bf16_autocast_on_request(runs, tmp_path, capsys):
    """--dtype bf16: the forward under bf16 autocast, a loss near float32's but not float32's."""
    rc, lines, err = _eval([runs / "sim", "--dtype", "bf16", "--json", tmp_path / "bf16.json"], capsys)
    assert rc == 0 and lines[-1].endswith("; on cpu in bf16"), err
    row = json.loads((tmp_path / "bf16.json").read_text())[0]
    fp32 = _logged(runs / "sim")[4]
    assert row["dtype"] == "bf16" and row["loss"] == pytest.approx(fp32, rel=2e-2) and row["loss"] != fp32


@pytest.mark.cuda
def test_on_cuda_auto_is_bf16_and_equals_a_cuda_runs_eval_loss(tmp_path, capsys):
    """A run trained on the GPU (bf16 autocast, --dtype auto) evaluated there with --dtype auto."""
    run = tmp_path / "gpu"
    assert train([*FLAGS, "--simulate", "--device", "cuda", "--no-compile", "--out", str(run)]) == 0
    rc, lines, err = _eval([run, "--json", tmp_path / "rows.json"], capsys)
    row = json.loads((tmp_path / "rows.json").read_text())[0]
    assert rc == 0 and (row["device"], row["dtype"]) == ("cuda", "bf16"), err
    assert row["loss"] == pytest.approx(_logged(run)[4], rel=5e-3)


def test_batches_and_batch_size_set_the_windows(runs, tmp_path, capsys):
    rc, _, _ = _eval([runs / "sim", "--batches", "2", "--batch-size", "5", "--json", tmp_path / "r.json"], capsys)
    row = json.loads((tmp_path / "r.json").read_text())[0]
    assert rc == 0 and row["tokens"] == 2 * 5 * 32
    # the run's own batches are the first 3 x 8 windows spread over the split, not these
    assert row["loss"] != pytest.approx(_logged(runs / "sim")[4], rel=1e-6)


@pytest.mark.parametrize("loss, shown", [(float("nan"), "nan"), (1e4, "inf")])
def test_a_non_finite_figure_is_printed_and_written_null(runs, tmp_path, capsys, monkeypatch, loss, shown):
    monkeypatch.setattr(ev, "mean_loss", lambda *args: loss)
    rc, lines, _ = _eval([runs / "sim", "--json", tmp_path / "r.json"], capsys)
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    row = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)[0]
    assert rc == 0 and lines[1].split()[3] == shown and row["perplexity"] is None
    assert row["loss"] == (None if math.isnan(loss) else loss)


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory, texts):
    """train.txt prepared with a byte-level BPE (another vocabulary than bytes)."""
    from asyncpp_ext.data import prepare as prep
    root = tmp_path_factory.mktemp("eval_bpe")
    train_bpe(root / "tokenizer.json", (texts / "train.txt").read_text(errors="ignore"), 280)
    assert prep.main(["--tokenizer", str(root / "tokenizer.json"), "--input", str(texts / "train.txt"),
                      "--out", str(root / "c.bin")]) == 0
    return root / "c.bin"


def test_data_of_another_tokenizer_is_refused(runs, bpe_data, capsys):
    rc, lines, err = _eval([runs / "sim", "--data", bpe_data], capsys)
    assert rc == 2 and err.count("\n") == 1 and "its loss would mean nothing" in err, err


@pytest.mark.parametrize("flags, words", [
    (["--batches", "0"], "--batches must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--json", "/nonexistent/dir/rows.json"], "its directory does not exist"),
    (["--data", "/nonexistent.bin"], "/nonexistent.bin"),
    (["--batches", "100000"], "distinct ones"),
])
def test_bad_inputs_give_one_line_and_exit_2(runs, capsys, flags, words):
    rc, _, err = _eval([runs / "sim", *flags], capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("asyncpp-eval: error: ") and words in err, err


def test_a_directory_without_checkpoints_is_one_line(tmp_path, capsys):
    rc, _, err = _eval([tmp_path, "--every-checkpoint"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "checkpoint" in err
