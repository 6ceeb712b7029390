"""Per-stage memory of gpipe / 1f1b / 2bw / pipedream, EF off, on (own buffer) and from the weight versions: measured against docs/design.md §3.

Each run trains the preset GPT over S processes with ``track_memory=True`` and reads every stage's
``host.memory_report()``: bytes of weight versions, gradient buffer, optimizer state (AdamW moments
plus the EF buffer when ef_beta > 0 with ef_source "buffer"; none with "weights") and the measured peak of in-flight activations (autograd's
saved tensors, see asyncpp_ext/pipeline/memory.py), plus the process's max RSS as a sanity column
(it also holds torch itself, the data and the allocator's slack, so it is not expected to match).

    python bench/memory.py [--model small|tiny] [--stages 4] [--microbatches 8]
                           [--micro-batch-size 4] [--steps 3] [--schedules gpipe 1f1b 2bw pipedream]
                           [--ef off|on|weights|both|all] [--json]

pipedream takes one microbatch per step: it runs with one microbatch of m x micro-batch-size
sequences (the same batch per update as the others).

Predicted (docs/design.md §3, memory per stage s of S):
  weights      S - s versions for pipedream, 2 for 2bw, 1 for gpipe/1f1b (x the stage's parameter
               bytes P)
  optimizer    AdamW: 2 P, +1 P with EF
  activations  A_s x in-flight count, where A_s is the measured activation bytes of ONE microbatch
               on stage s (the stage's blocks run once in this process under the same meter) and
               the count is min(S - s, m) for 1f1b/2bw, m for gpipe, min(S - s, steps) for pipedream
               (its microbatches are its steps).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_command import ArgumentParser  # noqa: E402
from gpt_workload import (GPT, adamw_factory, build_gpt, machine_description, minibatches,  # noqa: E402
                          stage_module)
from asyncpp_ext.pipeline import Pipeline, init_distributed, spawn  # noqa: E402
from asyncpp_ext.pipeline.memory import ActivationMeter  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "2bw", "pipedream")
EF_BETA_ON = 0.5
MIB = 1024 * 1024


EF_SETTINGS = {"off": (0.0, "buffer"), "on": (EF_BETA_ON, "buffer"), "weights": (EF_BETA_ON, "weights")}
"""--ef setting -> (ef_beta, ef_source): off, EF with its own buffer, EF from the weight versions."""
SYNC_SCHEDULES = ("gpipe", "1f1b")  # one weight version: no W(t-1) for EF "weights" to read


def worker(schedule, ef, model, m, micro_batch, steps, out_prefix):
    torch.set_num_threads(1)
    init_distributed(300)
    pipe = Pipeline(build_gpt(model), loss_fn=GPT.loss, optimizer=adamw_factory(*EF_SETTINGS[ef]), schedule=schedule,
                    microbatches=m, track_memory=True)
    for _ in pipe.train(minibatches(model, m, micro_batch), steps):
        pass
    report = pipe.host.memory_report()
    flat = pipe.host.flat[0]
    report["param_bytes"] = flat.numel() * flat.element_size()
    report["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    with open(f"{out_prefix}-stage{pipe.stage}.json", "w") as fh:
        json.dump(report, fh)


def one_microbatch_activation_bytes(model: str, stages: int, m: int, micro_batch: int) -> list[int]:
    """Bytes autograd saves for one microbatch on each stage, measured by running that stage's blocks
    once under the runtime's ActivationMeter, exactly as a stage's forward runs them (a received
    input that requires grad, and on the last stage the loss divided by m)."""
    gpt = build_gpt(model)
    x, y = next(minibatches(model, m, micro_batch))[0]
    per_stage = []
    for s in range(stages):
        module = stage_module(gpt, stages, s)
        inp = x if s == 0 else x.detach().requires_grad_()
        meter = ActivationMeter(exclude=list(module.parameters()))
        with torch.enable_grad(), meter.track():
            out = module(inp)
            if s == stages - 1:
                out = GPT.loss(out, y) / m
        per_stage.append(meter.current)
        x = out.detach()
        del out, inp
    return per_stage


def batching(schedule: str, m: int, micro_batch: int) -> tuple[int, int]:
    """(microbatches, micro-batch size) a schedule runs with: pipedream takes the whole minibatch as
    its one microbatch."""
    return (1, m * micro_batch) if schedule == "pipedream" else (m, micro_batch)


def in_flight(schedule: str, stages: int, stage: int, m: int, steps: int) -> int:
    if schedule == "pipedream":
        return min(stages - stage, steps)
    return m if schedule == "gpipe" else min(stages - stage, m)


def weight_versions(schedule: str, stages: int, stage: int) -> int:
    return {"pipedream": stages - stage, "2bw": 2}.get(schedule, 1)


def predict(schedule: str, ef: str, stages: int, stage: int, m: int, steps: int, param_bytes: int,
            act_one: int) -> dict:
    return {"weights": weight_versions(schedule, stages, stage) * param_bytes,
            "grads": param_bytes,
            "optimizer_state": (3 if ef == "on" else 2) * param_bytes,  # "weights" stores nothing
            "peak_activations": act_one * in_flight(schedule, stages, stage, m, steps)}


def measure(model: str, stages: int, m: int, micro_batch: int, steps: int,
            schedules=SCHEDULES, ef_settings=("off", "on", "weights")) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in schedules:
            mbs, size = batching(schedule, m, micro_batch)
            act_one = one_microbatch_activation_bytes(model, stages, mbs, size)
            for ef in ef_settings:
                if ef == "weights" and schedule in SYNC_SCHEDULES:
                    continue
                prefix = os.path.join(tmp, f"{schedule}-{ef}")
                spawn(worker, stages, (schedule, ef, model, mbs, size, steps, prefix))
                for s in range(stages):
                    with open(f"{prefix}-stage{s}.json") as fh:
                        got = json.load(fh)
                    want = predict(schedule, ef, stages, s, mbs, steps, got["param_bytes"], act_one[s])
                    measured = {k: got[k] for k in want}
                    rows.append({"schedule": schedule, "ef": ef != "off",
                                 "ef_source": None if ef == "off" else EF_SETTINGS[ef][1], "stage": s, "param_bytes": got["param_bytes"],
                                 "weight_versions": got["weight_versions"],
                                 "activation_bytes_one_microbatch": act_one[s],
                                 "in_flight": in_flight(schedule, stages, s, mbs, steps),
                                 "measured": measured, "predicted": want,
                                 "measured_total": sum(measured.values()), "predicted_total": sum(want.values()),
                                 "max_rss": got["max_rss"]})
    return {"model": model, "stages": stages, "microbatches": m, "micro_batch_size": micro_batch,
            "steps": steps, "ef_beta_on": EF_BETA_ON, "optimizer": "adamw", "machine": machine_description(),
            "rows": rows}


def _mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def _ef_label(row: dict) -> str:
    """off, on (EF with its buffer) or wts (EF from the weight versions: no buffer)."""
    return "off" if not row["ef"] else ("wts" if row.get("ef_source") == "weights" else "on")


def format_report(r: dict) -> str:
    lines = [f"# {r['model']} GPT, S={r['stages']} m={r['microbatches']} micro-batch {r['micro_batch_size']}, "
             f"{r['steps']} steps, AdamW (EF beta {r['ef_beta_on']} when on); MiB, measured/predicted; "
             f"{r['machine']}",
             f"  {'schedule':<10}{'EF':<4}{'stage':>5}{'weights':>15}{'grads':>8}{'opt state':>15}"
             f"{'act 1 mb':>10}{'in-flight':>10}{'peak activations':>19}{'total':>17}{'max RSS':>9}"]
    for row in r["rows"]:
        me, pr = row["measured"], row["predicted"]
        lines.append(
            f"  {row['schedule']:<10}{_ef_label(row):<4}{row['stage']:>5}"
            f"{_mib(me['weights']) + '/' + _mib(pr['weights']):>15}{_mib(me['grads']):>8}"
            f"{_mib(me['optimizer_state']) + '/' + _mib(pr['optimizer_state']):>15}"
            f"{_mib(row['activation_bytes_one_microbatch']):>10}{row['in_flight']:>10}"
            f"{_mib(me['peak_activations']) + '/' + _mib(pr['peak_activations']):>19}"
            f"{_mib(row['measured_total']) + '/' + _mib(row['predicted_total']):>17}{row['max_rss'] / MIB:>9.0f}")
    mismatches = [row for row in r["rows"] if row["measured"] != row["predicted"]]
    lines.append(f"  {len(r['rows']) - len(mismatches)} of {len(r['rows'])} stage rows match the formula "
                 "byte for byte" + ("" if not mismatches else "; differing: " + ", ".join(
                     f"{x['schedule']}/EF {_ef_label(x)}/stage {x['stage']}" for x in mismatches)))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=("tiny", "small"))
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps per run (>= 2: 2bw holds two versions "
                                                        "and EF its buffer from the first step on)")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--ef", choices=("off", "on", "weights", "both", "all"), default="all",
                   help="error feedback setting(s): off, on (its own buffer), weights (previous update read "
                        "from the weight versions; delayed schedules only), both = off+on, all (default)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    for name, low in (("stages", 1), ("microbatches", 1), ("micro_batch_size", 1), ("steps", 2)):
        if getattr(a, name) < low:  # steps: the memory 2bw and EF hold from their second step on
            p.error(f"--{name.replace('_', '-')} must be >= {low} (got {getattr(a, name)})")
    if a.microbatches < a.stages:
        p.error(f"--microbatches must be >= --stages ({a.stages}): 2bw needs one microbatch per stage")
    ef_settings = {"off": ("off",), "on": ("on",), "weights": ("weights",), "both": ("off", "on"),
                   "all": ("off", "on", "weights")}[a.ef]
    if ef_settings == ("weights",) and set(a.schedules) <= set(SYNC_SCHEDULES):
        p.error(f"--ef weights reads the previous weight version, which {' and '.join(a.schedules)} do not keep: "
                "nothing to measure; add --schedules 2bw or pipedream, or choose another --ef")
    result = measure(a.model, a.stages, a.microbatches, a.micro_batch_size, a.steps, a.schedules, ef_settings)
    print(json.dumps(result, indent=2) if a.json else format_report(result))
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
