"""bench/block_bytes.py: inductor's byte estimates per compiled block form, on the CPU."""
import json

import pytest

from bench_loader import load_bench_script


def test_the_forms_differ_as_their_code_says(capsys):
    # llama-tiny, one 32-token sequence: the three forms the stacked products are weighed with.
    # Two products for gate and up are three more matrix products (forward one, backward two) and
    # more bytes; the weights concatenated per call are kernels of their own (the copies into the
    # stacked weight), with the same matrix products
    from torch._inductor import scheduler

    bench = load_bench_script("block_bytes")
    codegen = scheduler.Scheduler.codegen
    assert bench.main(["--model", "llama-tiny", "--seq-len", "32", "--tokens", "32",
                       "--forms", "compiled,separate-gate-up,concat-weights", "--json", "-"]) == 0
    assert scheduler.Scheduler.codegen is codegen  # the counting hook is gone again
    rows = {r["form"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    stacked, separate, concat = rows["compiled"], rows["separate-gate-up"], rows["concat-weights"]
    assert stacked["generated_kernels"] > 0 and stacked["extern_kernels"] > 0
    assert separate["extern_kernels"] == stacked["extern_kernels"] + 3
    assert separate["total_kb_per_token"] > stacked["total_kb_per_token"]
    assert concat["extern_kernels"] == stacked["extern_kernels"]
    assert concat["generated_kernels"] > stacked["generated_kernels"]
    assert concat["generated_kb_per_token"] > stacked["generated_kb_per_token"]
    for r in rows.values():
        assert r["total_kb_per_token"] == pytest.approx(r["generated_kb_per_token"] + r["extern_kb_per_token"], abs=0.11)


def test_a_cache_forced_on_is_refused():
    # a graph served from inductor's cache is never scheduled, so it would count nothing; an
    # environment variable forcing the cache on wins over the tool's config patch
    import os
    import subprocess
    import sys

    from bench_loader import BENCH

    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "block_bytes.py"), "--model", "llama-tiny", "--seq-len", "32",
                           "--tokens", "32", "--forms", "compiled"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("block_bytes: ") and "forces inductor's caches on" in err and "\n" not in err, err


@pytest.mark.parametrize("argv, words", [
    (["--forms", "eager"], "'eager' is not a compiled form with code of its own"),
    (["--forms", "compiled,nope"], "'nope' is not a compiled form"),
    (["--forms", "pdl"], "'pdl' is not a compiled form with code of its own"),  # Triton options only
    (["--forms", ","], "--forms is empty"),
    (["--model", "no-such-model"], "--model no-such-model"),
    (["--tokens", "48", "--seq-len", "32", "--model", "llama-tiny"], "--tokens must be a multiple of --seq-len"),
    (["--tokens", "many"], "argument --tokens: invalid int value: 'many'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    bench = load_bench_script("block_bytes")
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err
