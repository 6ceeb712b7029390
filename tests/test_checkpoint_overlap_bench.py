"""bench/checkpoint_overlap.py --quick: both modes run and the check column compares them."""
import json

from bench_loader import load_bench_script


def test_quick_bench_checks_the_two_modes_agree(capsys):
    bench = load_bench_script("checkpoint_overlap")
    assert bench.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["check"] == "ok" and set(report["modes"]) == {"no-async", "async"}
    sizes = [report["modes"][mode]["checkpoint_bytes"] for mode in ("async", "no-async")]
    # equal tensors (the check); the shards' sizes differ only by the pickled RNG state of each
    # process (Python's own generator, unseeded: its integers pickle to varying lengths)
    assert min(sizes) > 0 and abs(sizes[0] - sizes[1]) < 1024, sizes
