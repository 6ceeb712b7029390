"""bench/data_batches.py --quick: one file and a three-source mixture timed side by side, the check
column confirming the mixture's counts by source and every minibatch's shape."""
import json

from bench_loader import load_bench_script


def test_quick_bench_times_both_and_checks_the_mixture(capsys):
    bench = load_bench_script("data_batches")
    assert bench.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["check"] == "ok" and len(report["rows"]) == 4
    assert {(r["data"], r["sampling"]) for r in report["rows"]} == {
        (d, s) for d in ("one file", "mixture 5:3:2") for s in ("random", "epoch")}
    assert all(r["ms_per_minibatch"] > 0 and r["check"] == "ok" for r in report["rows"])
