"""bench/checkpoint_overlap.py --quick: both modes run and the check column compares them."""
import json

from bench_loader import load_bench_script


def test_quick_bench_checks_the_two_modes_agree(capsys):
    bench = load_bench_script("checkpoint_overlap")
    assert bench.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["check"] == "ok" and set(report["modes"]) == {"no-async", "async"}
    assert report["modes"]["async"]["checkpoint_bytes"] == report["modes"]["no-async"]["checkpoint_bytes"] > 0
