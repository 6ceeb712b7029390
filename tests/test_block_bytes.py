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


@pytest.mark.parametrize("argv, words", [
    (["--forms", "eager"], "'eager' is not a compiled form"),
    (["--forms", "compiled,nope"], "'nope' is not a compiled form"),
    (["--model", "no-such-model"], "--model no-such-model"),
    (["--tokens", "16", "--seq-len", "32", "--model", "llama-tiny"], "--tokens must be at least --seq-len"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    bench = load_bench_script("block_bytes")
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err
