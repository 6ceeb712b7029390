"""Smoke test of bench/executor_overhead.py at tiny settings: it runs, and its breakdown adds up."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import executor_overhead  # noqa: E402


@pytest.mark.multiproc
def test_overhead_bench_reports_ours_against_torch_with_a_breakdown_that_adds_up(capsys):
    """2 stages, 2 microbatches, 3 timed steps: our 2bw over gloo and torch's 1f1b (its baseline)."""
    assert executor_overhead.main(["--stages", "2", "--microbatches", "2", "--steps", "3", "--warmup", "1",
                                   "--schedules", "2bw", "--transports", "gloo", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["stages"], result["microbatches"], result["steps"]) == (2, 2, 3)
    assert result["cpu"] and result["torch"]
    rows = {(r["runtime"], r["schedule"], r["transport"]): r for r in result["rows"]}
    assert set(rows) == {("ours", "2bw", "gloo"), ("torch", "1f1b", "gloo")}
    assert all(r["us_per_microbatch"] > 0 for r in rows.values())
    ours, theirs = rows["ours", "2bw", "gloo"], rows["torch", "1f1b", "gloo"]
    parts = [ours[key] for key in executor_overhead.BREAKDOWN]
    assert ours["forward_us"] > 0 and ours["backward_us"] > 0 and ours["optimizer_step_us"] > 0
    assert ours["send_us"] > 0 and ours["recv_wait_us"] >= 0 and ours["executor_loop_us"] > 0
    # The parts are each stage's wall split up, averaged over stages; the headline is the slowest stage's.
    assert sum(parts) <= ours["us_per_microbatch"] * 1.01
    assert len(ours["stages"]) == 2
    for stage in ours["stages"]:
        assert sum(stage[key] for key in executor_overhead.BREAKDOWN) == pytest.approx(stage["wall_us"])
        assert stage["compute_us"] > 0
        assert stage["callback_host_us"] == pytest.approx(stage["forward_us"] + stage["backward_us"]
                                                          - stage["compute_us"])
    assert ours["ratio_to_torch"] == pytest.approx(ours["us_per_microbatch"] / theirs["us_per_microbatch"])
    assert ours["ratio_baseline"] == "torch 1f1b" and theirs["ratio_to_torch"] == 1.0
    slowest_compute = max(stage["compute_us"] for stage in ours["stages"])
    step_alone = ours["optimizer_step_alone_us"]
    assert step_alone > 0 and theirs["optimizer_step_alone_us"] == step_alone
    for row in (ours, theirs):  # beyond the compute and the optimizer steps (one per 2 microbatches) both pay
        assert row["runtime_us"] == pytest.approx(row["us_per_microbatch"] - slowest_compute - step_alone / 2)
    assert ours["runtime_ratio_to_torch"] == pytest.approx(ours["runtime_us"] / theirs["runtime_us"])
    table = executor_overhead.format_table(result)
    assert "# runtime schedule  transport" in table and "recv-wait" in table and "rt-ratio" in table
    assert f"any runtime could reach here): torch 1f1b {slowest_compute / theirs['us_per_microbatch']:.2f}" in table
    assert "ours    2bw       gloo" in table and "torch   1f1b      gloo" in table
    assert f"# optimizer step alone (torch SGD, median of 200): {step_alone:.1f} us" in table


def test_pipedream_pays_a_step_per_microbatch_the_others_one_per_step():
    assert executor_overhead.steps_per_microbatch("pipedream", 8) == 1.0
    assert executor_overhead.steps_per_microbatch("2bw", 8) == executor_overhead.steps_per_microbatch("gpipe", 8) == 0.125


def test_overhead_bench_transports_follow_the_runtimes_list():
    """Every CPU transport the runtime names is measured by default, none hard-coded here."""
    from asyncpp_ext.pipeline.devices import TRANSPORTS

    assert set(executor_overhead.DEFAULT_TRANSPORTS) == set(TRANSPORTS) - {"auto", "nccl"}
    assert executor_overhead.torch_baseline("pipedream") == "1f1b"
    assert executor_overhead.torch_baseline("gpipe") == "gpipe"


@pytest.mark.parametrize("kwargs,message", [
    ({"transports": ("nccl",)}, "transport 'nccl' in --transports cannot run on CPU"),
    ({"schedules": ("zb",)}, "unknown schedule 'zb' in --schedules"),
    ({"m": 1, "schedules": ("2bw",)}, "2bw needs --microbatches >= --stages"),
    ({"repeats": 0}, "--repeats must be >= 1"),
    ({"schedules": ()}, "--schedules is empty; name one or more of gpipe,1f1b,2bw,pipedream"),
    ({"transports": ()}, "--transports is empty; name one or more of"),
])
def test_overhead_bench_refuses_settings_it_cannot_run(kwargs, message):
    with pytest.raises(executor_overhead.OverheadBenchError, match=message):
        executor_overhead.measure(**kwargs)


def test_overhead_bench_keeps_each_runs_fastest_repeat(monkeypatch):
    """Repeats go round-robin; each row is its run's fastest, with every repeat's figure kept."""
    times = {("ours", "2bw"): iter([900.0, 600.0, 700.0]), ("torch", "1f1b"): iter([2000.0, 2500.0, 1500.0])}

    def fake_run(runtime, schedule, transport, *_):
        return {"runtime": runtime, "schedule": schedule, "transport": transport,
                "us_per_microbatch": next(times[runtime, schedule])}

    monkeypatch.setattr(executor_overhead, "_one_run", fake_run)
    monkeypatch.setattr(executor_overhead, "stage_compute_us", lambda stage, stages: 1.0)
    monkeypatch.setattr(executor_overhead, "optimizer_step_alone_us", lambda: 1.0)
    rows = executor_overhead.measure(schedules=("2bw",), transports=("gloo",), repeats=3)
    assert [(r["runtime"], r["us_per_microbatch"]) for r in rows] == [("ours", 600.0), ("torch", 1500.0)]
    assert rows[0]["us_per_microbatch_repeats"] == [900.0, 600.0, 700.0]
    assert rows[1]["us_per_microbatch_repeats"] == [2000.0, 2500.0, 1500.0]
    assert rows[0]["ratio_to_torch"] == pytest.approx(600.0 / 1500.0)
    floor = 1.0 + 1.0 / 8  # compute alone + the optimizer step alone spread over m = 8 microbatches
    assert rows[0]["runtime_ratio_to_torch"] == pytest.approx((600.0 - floor) / (1500.0 - floor))


def test_overhead_bench_reports_a_failed_run_and_goes_on(monkeypatch, capsys):
    """A run whose ranks fail becomes a FAILED row with the reason; the others are still measured."""
    from asyncpp_ext.pipeline import LaunchError

    def fake_run(runtime, schedule, transport, *_):
        if transport == "torch":
            raise LaunchError("rank 1 stalled (exit code 4); all ranks have stopped")
        return {"runtime": runtime, "schedule": schedule, "transport": transport, "us_per_microbatch": 500.0,
                **{key: 1.0 for key in executor_overhead.BREAKDOWN}, "compute_us": 1.0, "callback_host_us": 1.0,
                "stages": [{"stage": 0, "compute_us": 1.0}]}

    monkeypatch.setattr(executor_overhead, "_one_run", fake_run)
    monkeypatch.setattr(executor_overhead, "stage_compute_us", lambda stage, stages: 1.0)
    assert executor_overhead.main(["--schedules", "1f1b", "--transports", "gloo,torch"]) == 1
    table = capsys.readouterr().out
    assert "ours    1f1b      torch       FAILED: rank 1 stalled (exit code 4)" in table
    assert "ours    1f1b      gloo         500.0" in table
