"""Pure pieces of the kit, tested on CPU: JUnit parsing, loss-curve comparison, the report's text."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

STATUSES = ("pass", "fail", "skipped", "not run")
FP32_REL_TOL = 1e-4
# The pipeline on one GPU vs the simulator on the same GPU, both fp32: the same update rule and the
# same kernels, so only the choice of kernels for the per-stage shapes can differ (measured on an
# H100: 5e-8 at most over 20 steps, deterministic run to run). Training on the wrong weight version
# moves the tiny model's loss by 2e-2 from the first delayed step, so 1e-5 separates the two by far.
SAME_DEVICE_REL_TOL = 1e-5
# bf16 autocast vs the fp32 simulator: bf16 keeps 8 significant bits (rounding 2^-9 = 0.2% per
# operation), and the two trajectories drift apart over the steps, so they are compared as curves:
# every step within BF16_STEP_BAND of the fp32 loss, the mean of the last 10 steps within
# BF16_TAIL_BAND. A broken bf16 path (wrong casts, lost gradients) misses these by far more.
BF16_STEP_BAND = 0.05
BF16_TAIL_BAND = 0.02


def parse_junit(path: Path) -> dict:
    """Counts and failures of a pytest --junitxml file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                first = (node.get("message") or node.text or "").strip().splitlines()
                failed.append(dict(test=f"{case.get('classname')}::{case.get('name')}", kind=tag,
                                   message=first[0][:300] if first else ""))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return dict(counts, failed=failed)


def read_losses(run_dir: Path) -> dict:
    """{step: training loss} from a run directory's metrics.jsonl (steps without a loss left out)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("loss") is not None:
                out[int(row["step"])] = float(row["loss"])
    return out


def compare_losses(reference: dict, got: dict, *, rel_tol: float | None = None, bitwise: bool = False,
                   step_band: float | None = None, tail_band: float | None = None) -> dict:
    """Per-step comparison of two {step: loss} curves. ok needs the same steps, finite losses and
    whichever of the bounds is given: bitwise equality, per-step relative difference <= rel_tol or
    <= step_band, and the relative difference of the last-10-step means <= tail_band."""
    result = dict(steps=len(reference), ok=True, problems=[])
    if not reference or sorted(reference) != sorted(got):
        result.update(ok=False, problems=[f"steps differ: {sorted(reference)[:5]}... vs {sorted(got)[:5]}..."])
        return result
    bad = [s for s in reference if not (math.isfinite(reference[s]) and math.isfinite(got[s]))]
    if bad:
        result.update(ok=False, problems=[f"non-finite loss at step {bad[0]}"])
        return result
    rel = {s: abs(got[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in reference}
    worst = max(rel, key=rel.get)
    result.update(max_rel=rel[worst], worst_step=worst, reference_at_worst=reference[worst], got_at_worst=got[worst],
                  final_reference=reference[max(reference)], final_got=got[max(got)])
    if bitwise and any(got[s] != reference[s] for s in reference):
        first = min(s for s in reference if got[s] != reference[s])
        result["problems"].append(f"not bitwise: first difference at step {first}")
    for bound in (rel_tol, step_band):
        if bound is not None and rel[worst] > bound:
            result["problems"].append(f"step {worst}: relative difference {rel[worst]:.3g} > {bound:g}")
    if tail_band is not None:
        tail = sorted(reference)[-10:]
        mean_ref = sum(reference[s] for s in tail) / len(tail)
        mean_got = sum(got[s] for s in tail) / len(tail)
        result["tail_rel"] = abs(mean_got - mean_ref) / max(abs(mean_ref), 1e-12)
        if result["tail_rel"] > tail_band:
            result["problems"].append(f"last-{len(tail)}-step mean differs by {result['tail_rel']:.3g} > {tail_band:g}")
    result["ok"] = not result["problems"]
    return result


def overall_status(sections: list) -> str:
    statuses = [s["status"] for s in sections]
    if "fail" in statuses:
        return "fail"
    return "not run" if all(s == "not run" for s in statuses) else "pass"


def _figure_lines(value, indent="  ") -> list:
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{indent}- {k}:")
                lines += _figure_lines(v, indent + "  ")
            else:
                lines.append(f"{indent}- {k}: {_fmt(v)}")
        return lines
    if isinstance(value, list):
        return [line for item in value for line in (_figure_lines(item, indent) if isinstance(item, (dict, list))
                                                     else [f"{indent}- {_fmt(item)}"])]
    return [f"{indent}- {_fmt(value)}"]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "(none)" if v is None or v == [] or v == {} else str(v)


def render_markdown(report: dict) -> str:
    """report.md: the verdict, one table row per section, then each section's figures."""
    lines = [f"# asyncpp_ext GPU check: {report['status'].upper()}", "",
             f"{report['summary']}", "",
             "| section | status | seconds | reason |", "| --- | --- | --- | --- |"]
    for s in report["sections"]:
        lines.append(f"| {s['title']} | {s['status']} | {s.get('seconds', 0):.0f} | {s.get('reason') or ''} |")
    for s in report["sections"]:
        lines += ["", f"## {s['title']}: {s['status']}", ""]
        if s.get("reason"):
            lines.append(f"{s['reason']}")
            lines.append("")
        if s.get("commands"):
            lines += ["```"] + [" ".join(c) for c in s["commands"]] + ["```", ""]
        if s.get("figures"):
            lines += _figure_lines(s["figures"], "")
    return "\n".join(lines) + "\n"
