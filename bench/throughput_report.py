"""The figures and the table of bench/gpu_throughput.py: a row's steady-state tokens/s, TFLOP/s and MFU,
its correctness check (the losses; the fused head loss against the plain one), the ours / Hugging Face
and 2bw / sync ratios, and the printed report."""
from __future__ import annotations

import math

from throughput_model import flops_per_token, matmul_params, model_shape, total_params
from throughput_rows import variant_suffixes

FIRST_LOSS_BAND = 0.10  # first-step loss within 10 % of ln V
DECREASE_MIN_STEPS = 4  # the decrease is asked for from this many steps on
HEAD_LOSS_REL_TOL = {"fp32": 1e-4, "bf16": 2e-2}


def steady_tokens_per_s(tokens: list, elapsed: list, warmup: int):
    """(tokens_K - tokens_W) / (t_K - t_W): the steps after ``warmup``; None if too few."""
    if len(tokens) <= warmup or warmup < 1 or len(tokens) < 2:
        return None
    dt = elapsed[-1] - elapsed[warmup - 1]
    return (tokens[-1] - tokens[warmup - 1]) / dt if dt > 0 else None


def loss_check(losses: list, vocab: int) -> str:
    if not losses or any(v is None or not math.isfinite(v) for v in losses):
        return "FAIL: non-finite loss"
    ln_v = math.log(vocab)
    if abs(losses[0] - ln_v) > FIRST_LOSS_BAND * ln_v:
        return f"FAIL: first loss {losses[0]:.3f}, ln V = {ln_v:.3f}"
    if len(losses) < DECREASE_MIN_STEPS:
        return "ok"  # too few steps to ask for a decrease (2bw's first update lands a step late)
    tail = losses[-max(1, len(losses) // 3):]
    if not sum(tail) / len(tail) < losses[0]:
        return "FAIL: loss not decreasing"
    return "ok"


def finish_row(r: dict, args, peak_tflops) -> dict:
    if r.get("status") != "ok":
        r["check"] = r.get("status", "error")
        return r
    if r["impl"] == "head":
        r["tokens_per_s"] = r["head_shape"]["batch"] * r["head_shape"]["seq"] / r["head_seconds"]
        return r
    shape = model_shape(r["model"], r["seq_len"])
    r["tokens_per_step"] = r["micro_batch_size"] * r["microbatches"] * r["seq_len"]
    r["flops_per_token"] = flops_per_token(shape, r["seq_len"])
    r["params_matmul"] = matmul_params(shape)
    r["tokens_per_s"] = steady_tokens_per_s(r["tokens"], r["elapsed_s"], args.warmup)
    r["tflops"] = r["tokens_per_s"] * r["flops_per_token"] / 1e12 if r["tokens_per_s"] else None
    gpus = r["gpus"] if args.device == "cuda" else 1
    r["mfu"] = r["tflops"] / (peak_tflops * gpus) if (r["tflops"] and peak_tflops) else None
    r["check"] = loss_check(r["losses"], shape["vocab_size"])
    if r["impl"] == "hf" and r.get("params") not in (None, total_params(shape)):
        r["check"] = f"FAIL: {r['params']} parameters, asyncpp's shape has {total_params(shape)}"
    return r


def head_checks(rows: list) -> None:
    plain = next((r for r in rows if r["impl"] == "head" and r["head_mode"] == "plain" and r.get("status") == "ok"), None)
    if plain:
        plain["check"] = "ok" if math.isfinite(plain["head_loss"]) else "FAIL: non-finite loss"
    for fused in (r for r in rows if r["impl"] == "head" and r["head_mode"].startswith("fused") and r.get("status") == "ok"):
        _check_fused(fused, plain)


def _check_fused(fused: dict, plain) -> None:
    """A fused head row (any chunk size) against the plain one: loss within the dtype's bound,
    its time and peak memory as ratios."""
    if plain:
        tol = HEAD_LOSS_REL_TOL[fused["dtype"]]
        rel = abs(fused["head_loss"] - plain["head_loss"]) / max(abs(plain["head_loss"]), 1e-12)
        fused["loss_rel_diff"] = rel
        fused["peak_ratio_to_plain"] = fused["peak_bytes"] / plain["peak_bytes"] if plain["peak_bytes"] else None
        fused["time_ratio_to_plain"] = fused["head_seconds"] / plain["head_seconds"]
        fused["check"] = "ok" if rel <= tol else f"FAIL: loss differs by {rel:.2e} (> {tol:g})"
    else:
        fused["check"] = "ok" if math.isfinite(fused["head_loss"]) else "FAIL: non-finite loss"


VARIANT_LOSS_TOL = 0.05
"""Largest relative difference, at any measured step, between the losses of an ours row and the
row it varies in how it computes (same seed, data and update rule): CUDA graphs, a stage region,
max-autotune, inductor options (cat-fused, combo-kernels, pdl, ...), another attention kernel, the compute copies, ipc for gloo,
the host's NaN/Inf check before the optimizer (host-check: the same numbers), the weight gradients
summed in float32 by their products (grad-accum-fusion: without each microbatch's bf16 rounding)
compute the same steps in other kernels or another float order, and a bf16 run drifts from its twin by bf16 rounding only (the GPU kit's bound for
bf16 against fp32 is 5 % per step). A broken variant is off by far more within a few steps: one
computed on the previous weight version misses smollm's early losses by ~10 %. --dtype bf16-params
rounds differently by design: its difference is reported, not checked."""


def _variants(r: dict) -> list:
    """The variant suffixes of ours row ``r``'s name, in name order (``eager`` is none: an eager row
    is a plain one)."""
    return [s for s in variant_suffixes(r) if s != " eager"]


def _variant_suffix(r: dict) -> str:
    """The name suffix of the variant ``r`` is (the last one it adds), or "" for a plain row."""
    variants = _variants(r)
    return variants[-1] if variants else ""


def _plainer(r: dict, find):
    """The row ``r`` varies: its name without its last variant suffix (graphs against none, bf16
    activations against autocast's, a stage region against blocks, max-autotune against inductor's
    default mode, an inductor preset against the compiled blocks' default options, ipc against
    gloo, ...); where this run has no such row, the next plainer one it has (graphs with a stage
    region against the plain row); None for a plain row."""
    name = r["name"]
    for suffix in reversed(_variants(r)):
        if not name.endswith(suffix):  # a name the table did not make
            return None
        name = name.removesuffix(suffix)
        base = find(name, r["model"], r["seq_len"])
        if base is not None:
            return base
    return None


def variant_checks(rows: list) -> None:
    """Each ours variant row's losses against the row it varies (``VARIANT_LOSS_TOL``): the
    difference as ``loss_vs``, and its check failed beyond the bound -- but for the variants that
    change the numbers by design (bf16-params' rounding, clipping's scaled steps, a document
    mask's other attention), whose difference is only recorded (flex against SDPA, both under the
    mask, is checked: the same attention by another kernel)."""
    ok = [r for r in rows if r.get("status") == "ok" and r["impl"] == "ours" and r.get("losses")]

    def find(name, model, seq):
        return next((r for r in ok if r["name"] == name and r["model"] == model and r["seq_len"] == seq), None)

    for r in ok:
        base = _plainer(r, find)
        if base is None or len(base["losses"]) != len(r["losses"]) or None in r["losses"] + base["losses"]:
            continue
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], base["losses"]))
        r["loss_vs"] = dict(row=base["name"], max_rel_diff=diff)
        changes_numbers = (r.get("dtype") == "bf16-params" or r.get("clip_grad_norm")
                           or (r.get("document_mask") is not None and base.get("document_mask") is None))
        if not changes_numbers and r.get("check") == "ok" and not diff <= VARIANT_LOSS_TOL:
            r["check"] = f"FAIL: losses differ from {base['name']}'s by up to {diff:.1e} (> {VARIANT_LOSS_TOL:g})"


def _one_stage_twin(r: dict, ok: list):
    """The one-stage ours row a two-stage row ``r`` is set against: same model, sequence and
    optimizer, computed alike (compiled or not, graphs or not, the same compile scope), without
    any other variant of VARIANT_SUFFIXES (no-copies, bf16-params, max-autotune, inductor options,
    another attention kernel, ...: a 2bw row has none of them); or None."""
    return next((b for b in ok if b["impl"] == "ours" and b["stages"] == 1 and b["model"] == r["model"]
                 and b["seq_len"] == r["seq_len"] and b["optimizer"] == r["optimizer"]
                 and b["compile"] == r["compile"] and bool(b.get("graphs")) == bool(r.get("graphs"))
                 and b.get("scope") == r.get("scope")
                 and not set(_variants(b)) - {" graphs", " stage-compile"}),  # no variant a 2bw row lacks
                None)


def ratios(rows: list) -> list:
    """ours / Hugging Face compiled (and eager) per (model, seq, optimizer); 2bw / ours sync."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s")]
    out = []

    def find(name, model, seq):
        return next((r for r in ok if r["name"] == name and r["model"] == model and r["seq_len"] == seq), None)

    for r in ok:
        if r["impl"] != "ours" or r["stages"] != 1:
            continue
        for base_name in (f"hf compile {r['optimizer']}", f"hf eager {r['optimizer']}"):
            base = find(base_name, r["model"], r["seq_len"])
            if base:
                out.append(dict(what=f"{r['name']} / {base_name}", model=r["model"], seq_len=r["seq_len"],
                                tokens_per_s=r["tokens_per_s"] / base["tokens_per_s"],
                                peak_memory=(r["peak_bytes"] / base["peak_bytes"]
                                             if r.get("peak_bytes") and base.get("peak_bytes") else None)))
        # the compute copies (a plain row) against the row without them; every other variant
        # against the row it varies
        if r.get("copies") is False:
            plain = None
        elif not _variant_suffix(r):
            plain = find(f"{r['name']} no-copies", r["model"], r["seq_len"])
        else:
            plain = _plainer(r, find)
        if plain:
            out.append(dict(what=f"{r['name']} / {plain['name']}", model=r["model"], seq_len=r["seq_len"],
                            tokens_per_s=r["tokens_per_s"] / plain["tokens_per_s"],
                            peak_memory=(r["peak_bytes"] / plain["peak_bytes"]
                                         if r.get("peak_bytes") and plain.get("peak_bytes") else None)))
        eager = None if r["compile"] is False else find(f"{r['name']} eager", r["model"], r["seq_len"])
        if eager:
            out.append(dict(what=f"{r['name']} (compile) / {eager['name']}", model=r["model"], seq_len=r["seq_len"],
                            tokens_per_s=r["tokens_per_s"] / eager["tokens_per_s"], peak_memory=None))
    for r in ok:
        if r["impl"] == "ours" and r["stages"] == 2:
            base = _one_stage_twin(r, ok)
            if base:
                out.append(dict(what=f"{r['name']} / {base['name']}", model=r["model"], seq_len=r["seq_len"],
                                tokens_per_s=r["tokens_per_s"] / base["tokens_per_s"], peak_memory=None,
                                note="per GPU" if r["gpus"] == 2 else None))
                if r["gpus"] == 2:
                    out[-1]["tokens_per_s"] /= 2
    return out


TARGETS = dict(mfu=0.40, vs_hf_compile=1.5, two_stages_one_gpu=0.90, quick_seconds=180.0)
"""What the GPU figures are measured against (docs/gpu.md): one stage's MFU at smollm-360m / 2048,
its tokens/s against the compiled Hugging Face model's (and peak memory at or below it), 2bw with
two stages sharing one GPU against one stage, and a --quick run's wall time."""


def targets(rows: list, seconds: float, mode: str) -> list:
    """Each target this run measured: (what, the figure, the bound, met?), for ours' default row
    (``ours sync adamw``) and, where a variant row does better, for the best one too."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s")]
    out = []

    def add(what, value, bound, met):
        out.append(dict(what=what, value=value, bound=bound, met=bool(met)))
    def ours_rows(model, seq):
        """ours' default row at (model, seq) and, where a variant that passed its checks is faster,
        the fastest such one (autocast's numbers: bf16-params rows are left out)."""
        same = [r for r in ok if r["impl"] == "ours" and r["stages"] == 1 and r["optimizer"] == "adamw"
                and r["model"] == model and r["seq_len"] == seq and r.get("dtype") is None and r.get("check") == "ok"]
        default = next((r for r in same if r["name"] == "ours sync adamw"), None)
        best = max(same, key=lambda r: r["tokens_per_s"], default=None)
        return [r for r in (default, best if best is not default else None) if r is not None]

    for hf in (r for r in ok if r["name"] == "hf compile adamw"):
        for r in ours_rows(hf["model"], hf["seq_len"]):
            at = f"{r['name']} {r['model']} T={r['seq_len']}"
            add(f"{at}: tokens/s / hf compile adamw's", r["tokens_per_s"] / hf["tokens_per_s"],
                f">= {TARGETS['vs_hf_compile']:g}", r["tokens_per_s"] >= TARGETS["vs_hf_compile"] * hf["tokens_per_s"])
            if r.get("peak_bytes") and hf.get("peak_bytes"):
                add(f"{at}: peak memory / hf compile adamw's", r["peak_bytes"] / hf["peak_bytes"], "<= 1",
                    r["peak_bytes"] <= hf["peak_bytes"])
    for r in ours_rows("smollm-360m", 2048):
        if r.get("mfu") is not None:
            add(f"{r['name']} {r['model']} T={r['seq_len']}: MFU", r["mfu"], f">= {TARGETS['mfu']:g}",
                r["mfu"] >= TARGETS["mfu"])
    for r in (r for r in ok if r["impl"] == "ours" and r["stages"] == 2 and r["gpus"] == 1):
        base = _one_stage_twin(r, ok)
        if base is not None:
            add(f"{r['name']} {r['model']} T={r['seq_len']}: tokens/s / {base['name']}'s",
                r["tokens_per_s"] / base["tokens_per_s"], f">= {TARGETS['two_stages_one_gpu']:g}",
                r["tokens_per_s"] >= TARGETS["two_stages_one_gpu"] * base["tokens_per_s"])
    if mode == "quick":
        add("--quick wall time, s", seconds, f"< {TARGETS['quick_seconds']:g}", seconds < TARGETS["quick_seconds"])
    return out


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f}"


def _f(v, fmt) -> str:
    return "n/a" if v is None else format(v, fmt)


TIMELINE_PHASES = ("start", "first_step", "steps", "work", "end")


def timeline_lines(rows: list, prestart: bool | None) -> list:
    """Where each row's wall time went (row_process.timeline): what a run's minutes are spent on."""
    seen, lines = set(), []
    for r in rows:
        t = r.get("timeline")
        if not t or id(t) in seen:  # the head-loss pair shares its process's
            continue
        seen.add(id(t))
        name = "head-loss" if r["impl"] == "head" else f"{r['name']} {r['model']} T={r['seq_len']}"
        parts = [f"{k.replace('_', ' ')} {t[k]:.1f}" for k in TIMELINE_PHASES if k in t]
        ahead = f" (+ {t['ahead']:.1f} ahead)" if "ahead" in t else ""
        lines.append(f"  {name:<58} {_f(r.get('wall_s'), '.1f'):>6} s: {', '.join(parts)}{ahead}")
    if not lines:
        return []
    return ["# wall time per row, s, from its turn: start = to its first step's clock (imports, device and "
            "model set-up, ranks), first step (compiles, captures), steps, end = after the last; ahead = "
            "before its turn, beside the row before (--prestart: " + ("on" if prestart else "off") + ")"] + lines


def format_report(report: dict) -> str:
    info = report["info"]
    w = max([len(r["name"]) + 2 for r in report["rows"]] + [30])  # the row column fits every name
    lines = [f"# asyncpp bench/gpu_throughput.py: {info['device_name']} ({info['device']}), torch {info['torch']}, "
             f"transformers {info['transformers'] or 'not installed'}, mode {info['mode']}, ours' fused head "
             f"{info.get('fused_head_kernel', 'n/a')}"
             + (" (rows with graphs: chunked)" if info["device"] == "cuda" else "")
             + (f", ours' attention kernel first: {info['attention_first']}" if info.get("attention_first") else ""),
             f"# peak {_f(info['peak_tflops'], 'g')} TFLOP/s ({info['peak_source']}); dtype {info['dtype']}; "
             f"{info['warmup']} warm-up + {info['steps']} measured steps per row; asyncpp-train flags: "
             + ", ".join(f"--{k.replace('_', '-')} {'yes' if v else 'absent'}" for k, v in info["cli_flags"].items()),
             f"# FLOPs/token = {report['formula']}",
             "# tokens/s = (tokens_K - tokens_W) / (t_K - t_W) after W warm-up steps; MFU = TFLOP/s / (GPUs x peak)",
             "# peak mem GiB: A = torch.cuda.max_memory_allocated (one process), R = peak RSS (one process, CPU), "
             "N = NVML device memory in use, sampled, all ranks (incl. CUDA contexts and caches), "
             "P = summed PSS of the process tree, sampled; H = measure_head_loss's own figure",
             "# check: losses finite, first within 10% of ln V, last third's mean below the first "
             "(ours and HF start from different weights: no step-by-step agreement expected); an ours "
             f"variant's losses within {VARIANT_LOSS_TOL:g} relative of the row it varies, at every step",
             f"# {'row':<{w}}{'model':<19}{'seq':>5}{'mb x n':>9}{'tok/step':>9}{'tokens/s':>11}{'TFLOP/s':>9}"
             f"{'MFU':>7}{'peak mem':>10}  {'loss 1 -> K':<16}{'check':<8}notes"]
    kinds = {"alloc": "A", "rss": "R", "nvml": "N", "pss": "P", "measure_head_loss": "H"}
    for r in report["rows"]:
        mem = f"{_gib(r.get('peak_bytes'))} {kinds.get(r.get('peak_kind'), '?')}" if r.get("peak_bytes") else "n/a"
        notes = list(r.get("notes", []))
        if r.get("status") != "ok":
            lines.append(f"  {r['name']:<{w}}{r['model']:<19}{r['seq_len']:>5}"
                         f"{r['micro_batch_size']:>4} x {r['microbatches']:<3}{'':>9}{'':>11}{'':>9}{'':>7}{'':>10}  "
                         f"{'':<16}{r.get('status', 'error'):<8}{r.get('error', '')}")
            continue
        if r["impl"] == "head":
            notes = [f"{r['head_seconds'] * 1e3:.1f} ms", f"loss {r['head_loss']:.4f}", r["dtype"], *notes]
            if "peak_ratio_to_plain" in r:
                notes.append(f"peak {_f(r['peak_ratio_to_plain'], '.3f')}x plain, time "
                             f"{r['time_ratio_to_plain']:.2f}x plain")
            lines.append(f"  {r['name']:<{w}}{r['model']:<19}{r['seq_len']:>5}{r['micro_batch_size']:>4} x 1  "
                         f"{r['micro_batch_size'] * r['seq_len']:>9}{_f(r['tokens_per_s'], '.0f'):>11}{'':>9}{'':>7}"
                         f"{mem:>10}  {'':<16}{r.get('check', ''):<8}{', '.join(notes)}")
            continue
        if r["impl"] == "ours" and r["stages"] == 2:
            notes.append(f"{r['transport']}, EF 0.5")
        if r.get("loss_vs"):
            notes.append(f"losses within {r['loss_vs']['max_rel_diff']:.1e} of {r['loss_vs']['row']}'s")
        if r.get("info", {}).get("note"):
            notes.append(r["info"]["note"])
        for who, prof in (r.get("profile") or {}).items():  # --profile; no device figures on CPU
            if prof["device_busy_share"] is not None:
                idle = prof.get("idle_between_ms_per_step")
                notes.append(f"{who}: device busy {prof['device_busy_share'] * 100:.0f}%, "
                             f"{prof['kernels_per_step']} kernels/step"
                             + (f", idle between kernels {idle:.1f} ms/step" if idle is not None else ""))
        loss = f"{r['losses'][0]:.2f} -> {r['losses'][-1]:.2f}" if r["losses"][0] is not None and \
            r["losses"][-1] is not None else "n/a"
        mfu = _f(r["mfu"] * 100 if r["mfu"] is not None else None, ".1f") + ("%" if r["mfu"] is not None else "")
        check = r["check"] if r["check"] == "ok" else "FAIL"
        if r["check"] != "ok":
            notes.append(r["check"])
        lines.append(f"  {r['name']:<{w}}{r['model']:<19}{r['seq_len']:>5}{r['micro_batch_size']:>4} x "
                     f"{r['microbatches']:<3}{r['tokens_per_step']:>9}{_f(r['tokens_per_s'], '.0f'):>11}"
                     f"{_f(r['tflops'], '.1f'):>9}{mfu:>7}{mem:>10}  {loss:<16}{check:<8}{', '.join(notes)}")
    for name, why in report["skipped"]:
        lines.append(f"  {name:<45}not run: {why}")
    lines += timeline_lines(report["rows"], report["info"].get("prestart"))
    if report["ratios"]:
        lines.append("# ratios (same model, sequence, optimizer, tokens per step; measured in this run)")
        for q in report["ratios"]:
            mem = f", peak memory {q['peak_memory']:.2f}x" if q.get("peak_memory") else ""
            lines.append(f"  {q['model']:<16} T={q['seq_len']:<5} {q['what']:<56} tokens/s {q['tokens_per_s']:.2f}x"
                         f"{' per GPU' if q.get('note') else ''}{mem}")
    if report.get("targets"):
        lines.append("# targets (docs/gpu.md; measured in this run)")
        for t in report["targets"]:
            lines.append(f"  {t['what']:<78} {t['value']:.3f} {t['bound']:<7} {'met' if t['met'] else 'NOT MET'}")
    s = report["summary"]
    lines.append(f"# {s['rows_ok']} of {s['rows']} rows ran, {s['checks_failed']} check(s) failed; "
                 f"{report['seconds']:.0f} s in all")
    return "\n".join(lines)
