"""bench/paper_study.py: the summariser on hand-made numbers (paired gaps and recovered shares),
a few-step run of every table (table, JSON and plot; --delay-only), and the checks that stop a study before
its first run (a missing optional package, a config field that does not exist)."""
import json
import math
import statistics
import sys

import pytest

from bench_loader import load_bench_script


@pytest.fixture(scope="module")
def study():
    return load_bench_script("paper_study")


TINY = ["--model", "tiny", "--steps", "4", "--seeds", "2", "--eval-every", "2", "--eval-batches", "1"]


# -- the summariser, on numbers whose paired and unpaired statistics differ -------------------------
def _settings(study, group):
    plain = (("optim.name", "muon"), ("optim.ef_beta", 0.0))
    return [study.Setting(group, "sync", "sync", "sync", plain),
            study.Setting(group, "2bw", "2bw", "delayed", plain),
            study.Setting(group, "2bw+x", "2bw", "mitigated", (("optim.name", "muon"),))]


def test_gap_and_recovered_share_are_paired_per_seed(study):
    finals = {"g sync": [2.0, 2.1, 2.2], "g 2bw": [2.4, 2.3, 2.6], "g 2bw+x": [2.2, 2.2, 2.3],
              # A second group with other numbers: rows must be compared within their own group.
              "h sync": [1.0, 1.0, 1.0], "h 2bw": [2.0, 2.0, 2.0], "h 2bw+x": [1.0, 1.5, 2.0]}
    results = [{"label": label, "seed": seed, "final_eval_loss": values[seed]}
               for label, values in finals.items() for seed in (2, 0, 1)]  # not in seed order
    summary = study.summarize(results, _settings(study, "g") + _settings(study, "h"))
    g = {v: summary[f"g {v}"] for v in ("sync", "2bw", "2bw+x")}
    assert g["sync"]["gap"] is None and g["sync"]["recovered"] is None
    assert g["sync"]["eval"] == pytest.approx([2.1, 0.1])
    # Gaps per seed: 2bw [0.4, 0.2, 0.4], 2bw+x [0.2, 0.1, 0.1].
    assert g["2bw"]["per_seed"]["gap"] == pytest.approx([0.4, 0.2, 0.4])
    assert g["2bw"]["gap"] == pytest.approx([1 / 3, statistics.stdev([0.4, 0.2, 0.4])])
    assert g["2bw"]["recovered"] is None
    # Recovered per seed: (0.4-0.2)/0.4, (0.2-0.1)/0.2, (0.4-0.1)/0.4 = 0.5, 0.5, 0.75. The mean of
    # the ratios (0.5833) is not the ratio of the mean gaps (0.6): the summary must pair by seed.
    assert g["2bw+x"]["per_seed"]["recovered"] == pytest.approx([0.5, 0.5, 0.75])
    assert g["2bw+x"]["recovered"] == pytest.approx([7 / 12, statistics.stdev([0.5, 0.5, 0.75])])
    assert g["2bw+x"]["gap"][1] == pytest.approx(statistics.stdev([0.2, 0.1, 0.1]))
    h = summary["h 2bw+x"]
    assert h["per_seed"]["gap"] == pytest.approx([0.0, 0.5, 1.0])
    assert h["per_seed"]["recovered"] == pytest.approx([1.0, 0.5, 0.0])


def test_a_share_of_no_gap_is_not_a_number_in_the_table(study):
    """A run too short for the delay to show has no 2bw gap: the recovered share is undefined."""
    finals = {"g sync": [2.0, 2.0], "g 2bw": [2.0, 2.0], "g 2bw+x": [2.0, 2.0]}
    results = [{"label": label, "seed": seed, "final_eval_loss": values[seed]}
               for label, values in finals.items() for seed in (0, 1)]
    summary = study.summarize(results, _settings(study, "g"))
    line = next(x for x in study.format_table(summary, [], 2).splitlines() if x.startswith("g 2bw+x"))
    assert line.endswith(" n/a") and "nan" not in line


def test_a_diverged_seed_makes_its_row_nan_not_an_error(study):
    finals = {"g sync": [2.0, 2.1], "g 2bw": [2.4, float("nan")], "g 2bw+x": [2.2, 2.3]}
    results = [{"label": label, "seed": seed, "final_eval_loss": values[seed]}
               for label, values in finals.items() for seed in (0, 1)]
    summary = study.summarize(results, _settings(study, "g"))
    assert summary["g sync"]["eval"] == pytest.approx([2.05, statistics.stdev([2.0, 2.1])])
    assert all(math.isnan(v) for v in summary["g 2bw"]["eval"] + summary["g 2bw"]["gap"])
    assert all(math.isnan(v) for v in summary["g 2bw+x"]["recovered"])
    assert "nan" in study.format_table(summary, [], 2)


def test_a_group_without_its_sync_row_is_refused(study):
    rows = _settings(study, "g")[1:]
    with pytest.raises(study.StudyError, match="one sync row"):
        study.summarize([], rows)


# -- two tables, a few steps of the tiny model --------------------------------------------------------
def test_optimizers_table_json_and_plot(study, tmp_path, capsys):
    plot = tmp_path / "optimizers.png"
    assert study.main(["optimizers", "--optimizers", "adamw,muon", *TINY, "--workers", "1",
                       "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["table"] == "optimizers" and out["setup"]["runs"] == 12
    labels = [f"{o} {v}" for o in ("adamw", "muon") for v in ("sync", "2bw", "2bw+ef0.5")]
    assert [s["label"] for s in out["settings"]] == labels == list(out["summary"])
    by_label = {s["label"]: s for s in out["settings"]}
    assert by_label["muon 2bw"]["overrides"] == {"optim.name": "muon", "optim.ef_beta": 0.0}
    assert by_label["muon 2bw+ef0.5"]["overrides"] == {"optim.name": "muon"}  # EF at its auto beta
    runs = {(r["label"], r["seed"]): r for r in out["runs"]}
    assert sorted(runs) == sorted((label, seed) for label in labels for seed in (0, 1))
    for r in out["runs"]:
        assert len(r["train_losses"]) == 4 and [s for s, _ in r["eval_curve"]] == [0, 2, 4]
    for seed in (0, 1):
        sync, delayed, ef = (runs[f"muon {v}", seed]["train_losses"] for v in ("sync", "2bw", "2bw+ef0.5"))
        # Same init and batches per seed: step 0 runs on W(0) everywhere; step 1 on W(1) vs W(0).
        assert sync[0] == delayed[0] == ef[0] and sync[1] != delayed[1]
    assert runs["muon sync", 0]["train_losses"][0] != runs["muon sync", 1]["train_losses"][0]
    final = {key: r["final_eval_loss"] for key, r in runs.items()}
    for o in ("adamw", "muon"):
        gaps = {v: [final[f"{o} {v}", s] - final[f"{o} sync", s] for s in (0, 1)] for v in ("2bw", "2bw+ef0.5")}
        row = out["summary"][f"{o} 2bw+ef0.5"]
        assert row["gap"][0] == pytest.approx(statistics.fmean(gaps["2bw+ef0.5"]), abs=1e-12)
        recovered = [(g0 - g1) / g0 for g0, g1 in zip(gaps["2bw"], gaps["2bw+ef0.5"])]
        assert row["recovered"] == pytest.approx([statistics.fmean(recovered), statistics.stdev(recovered)])
    assert plot.stat().st_size > 0


def test_sensitivity_table_in_worker_processes(study, capsys):
    from asyncpp_ext.training.config import LR_AUTO

    assert study.main(["sensitivity", "--optimizers", "adamw", *TINY, "--workers", "2"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("sensitivity:") and "budget 12 runs" in text[1] and "tiny GPT" in text[1]
    rows = {line.split("  ")[0]: line for line in text if line.startswith("adamw lr")}
    lrs = [LR_AUTO["adamw"] * scale for scale in (0.5, 1, 2)]
    assert sorted(rows) == sorted(f"adamw lr{lr:g} (x{s:g}) {v}" for lr, s in zip(lrs, (0.5, 1, 2))
                                  for v in ("sync", "2bw"))
    assert all(line.count("±") == (1 if line.split("  ")[0].endswith("sync") else 2) for line in rows.values())


# -- stops before the first run ----------------------------------------------------------------------
@pytest.fixture
def no_runs(study, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(study, "run_pool", refuse)


@pytest.mark.parametrize("library_module", [True, False], ids=["library-check", "fallback-check"])
def test_missing_extra_is_one_line_and_exit_2(study, no_runs, monkeypatch, capsys, library_module):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # import fails: package missing
    if not library_module:
        monkeypatch.setitem(sys.modules, "asyncpp_ext.optim.library", None)
    assert study.main(["optimizers", "--optimizers", "adamw,lion", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lion" in err[0] and "pip install 'asyncpp_ext[study]'" in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["optimizers", "--optimizers", "adamw", "--set", "optim.no_such_field=1"], "'optim.no_such_field' is not a config field"),
    (["optimizers", "--optimizers", "adamw", "--set", "optim.lr=-1"], "adamw sync: optim.lr must be a positive number"),
    (["momentum", "--optimizers", "adamw"], "muon_momentum"),
    (["optimizers", "--seeds", "0"], "--seeds must be >= 1"),
    (["tables"], "invalid choice"),
    # Found before the runs (minutes to hours), not when the figure is drawn at the end.
    (["optimizers", "--plot", "/"], "--plot / is a directory; name a file such as /curves.png"),
    (["optimizers", "--plot", "curves"], "--plot curves has no suffix to choose the format by"),
])
def test_bad_input_is_one_line_and_exit_2(study, no_runs, capsys, argv, message):
    assert study.main(argv + ["--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("table, optimizers, variants", [
    ("ef", "muon", [f"2bw+ef{b:g} {src}" for src in ("buffer", "weights") for b in (0.25, 0.5, 0.75, 1.0)]),
    ("mitigations", "muon,adamw", ["2bw ef0.5", "2bw predict", "2bw dc", "2bw lr-rescale"]),
    ("momentum", "muon", ["2bw+ef0.5"]),
])
def test_the_other_tables_run_every_row(study, capsys, table, optimizers, variants):
    """ef, mitigations and momentum at a tiny size: every row runs, each mitigated row gets a
    recovered share against its own group's sync and plain 2bw runs."""
    assert study.main([table, "--optimizers", optimizers, *TINY, "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    groups = {s["group"] for s in out["settings"]}
    if table == "momentum":
        assert groups == {"muon m0.9", "muon m0.95", "muon m0.98"}
        for s in out["settings"]:
            assert s["overrides"]["optim.muon_momentum"] == float(s["group"].split(" m")[1])
    else:
        assert groups == set(optimizers.split(","))
    for group in groups:
        rows = {s["variant"]: out["summary"][s["label"]] for s in out["settings"] if s["group"] == group}
        assert list(rows) == ["sync", "2bw", *variants]
        for variant in variants:
            assert len(rows[variant]["per_seed"]["recovered"]) == 2
            assert all(r == r for r in rows[variant]["per_seed"]["recovered"])  # not NaN: the run finished
    mitigated = {s["label"]: s["overrides"] for s in out["settings"] if s["role"] == "mitigated"}
    if table == "mitigations":
        assert mitigated["muon 2bw predict"] == {"optim.name": "muon", "optim.ef_beta": 0.0,
                                                 "optim.mitigation": "predict"}
    losses = {(r["label"], r["seed"]): r["train_losses"] for r in out["runs"]}
    plain = {s["group"]: s["label"] for s in out["settings"] if s["role"] == "delayed"}
    for s in out["settings"]:  # each mitigation changes the run within its 4 steps...
        if s["role"] == "mitigated" and not s["variant"].endswith(" dc"):
            # ...except DC-ASGD at its default lambda 0.04, whose correction (lambda g*g*dW) stays
            # below float32 resolution for 4 steps of this model (tests/test_mitigations.py checks
            # its arithmetic at lambda 1)
            assert losses[s["label"], 0] != losses[plain[s["group"]], 0], s["label"]


def test_delay_only_reaches_the_delayed_rows_only(study, capsys):
    """--delay-only others: the 2bw rows delay only the AdamW part; the sync row runs as before."""
    argv = ["optimizers", "--optimizers", "muon", *TINY, "--workers", "1", "--json"]
    assert study.main(argv) == 0
    every = json.loads(capsys.readouterr().out)
    assert study.main(argv + ["--delay-only", "others"]) == 0
    others = json.loads(capsys.readouterr().out)
    assert {s["label"]: s["overrides"].get("pipeline.delay_only") for s in others["settings"]} == {
        "muon sync": None, "muon 2bw": "others", "muon 2bw+ef0.5": "others"}
    losses = [{(r["label"], r["seed"]): r["train_losses"] for r in out["runs"]} for out in (every, others)]
    assert losses[0]["muon sync", 0] == losses[1]["muon sync", 0]
    assert losses[0]["muon 2bw", 0] != losses[1]["muon 2bw", 0]
