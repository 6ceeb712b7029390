"""The throughput bench's plan: which rows bench/gpu_throughput.py runs for a device, a mode and
asyncpp-train's flags (the newer ones detected from its --help), and which it skips and why."""
from __future__ import annotations

import importlib.util
import re

from throughput_model import BenchError
from throughput_rows import inductor_preset, variant_suffixes

DEFAULTS = {  # per device: models, sequence lengths, micro-batch (at the first length), microbatches
    # --micro-batch-size counts sequences of the first default length (1024 / 64); other lengths take
    # as many sequences as hold the same tokens (4 at 2048), so every row trains the same tokens per step.
    "cuda": dict(models=["smollm-135m", "smollm-360m"], seq_lens=[1024, 2048], micro_batch_size=8, microbatches=8),
    "cpu": dict(models=["llama-tiny", "llama-tiny-4x64"], seq_lens=[64, 128], micro_batch_size=8, microbatches=4),
}
DOCUMENT_MASK_TOKEN = 10
"""The document-mask row's boundary: the newline, which makes each line of the built-in corpus (the
rows' data) a document."""
HEAD_SHAPE = dict(batch=8, seq=1024, n_embd=576, vocab=49152)  # smollm-135m's head at micro-batch 8 x 1024
SMOKE_HEAD_SHAPE = dict(batch=2, seq=64, n_embd=64, vocab=512)


def detect_cli_flags() -> dict:
    """Which of the newer asyncpp-train flags exist (from its --help text, built in this process:
    a second interpreter importing torch would cost seconds)."""
    from asyncpp_ext.training.arguments import build_parser

    text = build_parser().format_help()
    return {"compile": "--no-compile" in text and re.search(r"--compile\b", text) is not None,
            "head_loss": "--head-loss" in text, "cuda_graphs": "--cuda-graphs" in text,
            "ipc": ",ipc" in text, "compute_copies": "--no-compute-copies" in text,
            "bf16_params": "bf16-params" in text, "compile_scope": "--compile-scope" in text,
            "compile_mode": "--compile-mode" in text, "attention": "--attention" in text,
            "inductor_option": "--inductor-option" in text, "nonfinite_check": "--nonfinite-check" in text,
            "gradient_accumulation_fusion": "--gradient-accumulation-fusion" in text,
            "clip_grad_norm": "--clip-grad-norm" in text, "document_mask": "--document-mask" in text,
            "attention_flex": re.search(r"--attention \{[^}]*\bflex\b", text) is not None,
            "no_checkpoints": "--no-checkpoints" in text and "--eval-batches" in text}


def row(name, impl, model, seq, mb, m, **kw) -> dict:
    r = dict(name=name, impl=impl, model=model, seq_len=seq, micro_batch_size=mb, microbatches=m,
             optimizer=kw.pop("optimizer", None), compile=kw.pop("compile", None), stages=kw.pop("stages", 1),
             gpus=kw.pop("gpus", 1), schedule=kw.pop("schedule", None), transport=kw.pop("transport", None),
             notes=kw.pop("notes", []))
    r.update(kw)
    return r


def build_plan(args, flags: dict, gpus: int) -> tuple[list, list]:
    """(rows to run, [(row name, why it is not run)])."""
    dev = args.device
    models, seqs = args.models, args.seq_lens
    ref = DEFAULTS[dev]["seq_lens"][0]  # --micro-batch-size counts sequences of this length
    mb_at = {t: max(1, args.micro_batch_size * ref // t) for t in seqs}  # same tokens per microbatch
    m = args.microbatches
    rows, skipped = [], []
    compile_ok = dev == "cuda" or args.cpu_compile
    ours_notes = [] if flags["compile"] else ["flags absent"]

    def ours(model, seq, opt, compile_=True, **kw):
        c = (compile_ if flags["compile"] else None)
        suffix = "".join(variant_suffixes({**kw, "compile": c}))
        if kw.get("stages", 1) == 1:
            name = f"ours sync {opt}{suffix}"
            kw.setdefault("schedule", "sync")
        else:
            name = f"ours 2bw 2st {kw['gpus']}gpu {opt}{suffix}"
            kw.setdefault("schedule", "2bw")
        anyway = kw.pop("cpu_compile_anyway", False)
        if c is True and not compile_ok and not anyway:
            skipped.append((f"{name} ({model}, T={seq})", "torch.compile on CPU: pass --cpu-compile"))
            return
        rows.append(row(name, "ours", model, seq, mb_at[seq], m, optimizer=opt, compile=c, notes=list(ours_notes), **kw))

    def hf(model, seq, opt, compile_):
        name = f"hf {'compile' if compile_ else 'eager'} {opt}"
        if compile_ and not compile_ok:
            skipped.append((f"{name} ({model}, T={seq})", "torch.compile on CPU: pass --cpu-compile"))
            return
        rows.append(row(name, "hf", model, seq, mb_at[seq], m, optimizer=opt, compile=compile_))

    # a row beside the default's with the other attention kernel: --attention auto is cudnn on
    # Hopper (then flash: cuDNN's kernels off) and torch's own choice elsewhere (then cudnn)
    other_attention = "flash" if getattr(args, "auto_attention", None) == "cudnn" else "cudnn"
    # --cuda-graphs rows beside the plain ones where asyncpp-train has the flag (CUDA only)
    graphs = [False, True] if dev == "cuda" and flags.get("cuda_graphs") else [False]

    def two_bw(model, seq, opt, variants=True):
        # Two ranks on one GPU: gloo (through host memory); on CUDA where the CLI has it also ipc
        # (CUDA IPC, no host copies), where --cuda-graphs goes. Without ``variants`` only the
        # transport a one-GPU user would pick (ipc where available), without graphs.
        ipc = dev == "cuda" and flags.get("ipc")
        if not variants:
            ours(model, seq, opt, compile_=main_compile, stages=2, gpus=1, transport="ipc" if ipc else "gloo")
        else:
            for g in [False] if ipc else graphs:
                ours(model, seq, opt, compile_=main_compile, stages=2, gpus=1, transport="gloo", graphs=g)
            for g in graphs if ipc else []:
                ours(model, seq, opt, compile_=main_compile, stages=2, gpus=1, transport="ipc", graphs=g)
        if dev == "cuda":
            if gpus >= 2:
                ours(model, seq, opt, compile_=main_compile, stages=2, gpus=2, transport="nccl")
            else:
                skipped.append((f"ours 2bw 2st 2gpu {opt} ({model}, T={seq})", f"needs 2 GPUs ({gpus} visible)"))

    cpu_eager = dev == "cpu" and not args.cpu_compile  # ours' main rows on CPU run eager unless asked
    main_compile = not cpu_eager
    first, last = (models[0], seqs[0]), (models[-1], seqs[-1])
    if args.mode == "smoke":
        mdl, seq = first
        ours(mdl, seq, "adamw", compile_=main_compile)
        two_bw(mdl, seq, "adamw")
        hf(mdl, seq, "adamw", False)
    elif args.mode == "quick":
        # The CLI's default configurations at the first point, within 3 minutes on one GPU: ours
        # sync (on CUDA with graphs, the CLI's default for sync there), the compiled Hugging Face
        # model (its whole-model compile is 80-90 s of the 3 minutes), 2bw on one GPU (without
        # graphs, the pipelines' default), the head pair. Every row is a process that compiles its
        # model, so a row costs half a minute or more: the sync row without graphs, which 2bw's
        # ratio to one stage needs (computed alike), other variants (gloo beside ipc, stage scope)
        # and the other points are the full mode's.
        mdl, seq = first
        ours(mdl, seq, "adamw", compile_=main_compile, graphs=graphs[-1])
        if flags["compile"] and cpu_eager:
            # compiled vs eager llama-tiny: the one compiled row that runs on CPU without --cpu-compile
            ours(mdl, seq, "adamw", compile_=True, cpu_compile_anyway=True)
        hf(mdl, seq, "adamw", compile_ok)  # compiled on the GPU, eager on CPU
        two_bw(mdl, seq, "adamw", variants=False)
    else:
        for mdl in models:
            for seq in seqs:
                primary = (mdl, seq) in (first, last)
                for g in graphs if primary else [False]:
                    ours(mdl, seq, "adamw", compile_=main_compile, graphs=g)
                if primary and dev == "cuda" and flags.get("attention"):
                    # the other attention kernel (above)
                    ours(mdl, seq, "adamw", compile_=main_compile, graphs=graphs[-1], attention=other_attention)
                if primary and dev == "cuda" and flags.get("compute_copies"):  # bf16 weight copies off
                    ours(mdl, seq, "adamw", compile_=main_compile, copies=False)
                if primary and dev == "cuda" and flags.get("bf16_params"):  # activations in bf16 too
                    ours(mdl, seq, "adamw", compile_=main_compile, dtype="bf16-params")
                if primary and flags.get("compile_scope") and (dev == "cuda" or (mdl, seq) == first):
                    # the stage's blocks as one compiled region (on CPU: one point, host work only),
                    # and on CUDA also with graphs: the two host-side remedies together
                    for g in graphs:
                        ours(mdl, seq, "adamw", compile_=True, scope="stage", graphs=g, cpu_compile_anyway=True)
                if (mdl, seq) == last and dev == "cuda" and flags.get("compile_mode"):
                    # inductor's max-autotune where the GPU, not the host, sets the pace, on top of
                    # the CLI's defaults (graphs: with sync on CUDA)
                    ours(mdl, seq, "adamw", compile_=True, compile_mode="max-autotune", graphs=graphs[-1])
                if (mdl, seq) == last and dev == "cuda" and flags.get("inductor_option"):
                    # the defaults with INDUCTOR_PRESETS' options on top: inductor's own
                    # concatenations (what the CUDA default of concatenations as kernels of their
                    # own is worth), its horizontal fusion, programmatic dependent launch, both,
                    # larger partial sums in the norms' backward; a preset this torch lacks, none
                    for preset in ("cat-fused", "combo-kernels", "pdl", "combo-kernels-pdl", "mix-order-64"):
                        if inductor_preset(preset):
                            ours(mdl, seq, "adamw", compile_=True, inductor=preset, graphs=graphs[-1])
                if (mdl, seq) == last and dev == "cuda" and flags.get("gradient_accumulation_fusion"):
                    # the weight gradients added into float32 by their products (no accumulate
                    # kernel after each microbatch), alone and with inductor's horizontal fusion:
                    # the candidate defaults together
                    for preset in (None, "combo-kernels"):
                        if preset is None or inductor_preset(preset):
                            ours(mdl, seq, "adamw", compile_=True, inductor=preset, graphs=graphs[-1],
                                 gradient_accumulation_fusion=True)
                if (mdl, seq) == last and dev == "cuda" and flags.get("nonfinite_check"):
                    # the step's NaN/Inf check read on the host before the optimizer is queued (the
                    # CLI's default queues it first): what the device-side skip is worth
                    ours(mdl, seq, "adamw", compile_=True, graphs=graphs[-1], nonfinite_check="host")
                if (mdl, seq) == last and dev == "cuda" and flags.get("clip_grad_norm"):
                    # clipping by the previous step's global norm at 1.0, as pretraining runs clip:
                    # the per-parameter norms, read in one copy, and the step's check on the host
                    # (the device-side skip does not combine with clipping)
                    ours(mdl, seq, "adamw", compile_=True, graphs=graphs[-1], clip_grad_norm=1.0)
                if (mdl, seq) == last and dev == "cuda" and flags.get("document_mask"):
                    # attention within documents, each line of the built-in corpus one (token 10):
                    # SDPA with a (B, T, T) boolean mask runs another kernel than the causal flag's
                    # (flash takes no mask), and CUDA graphs stay off under the mask -- set against
                    # the row without graphs
                    ours(mdl, seq, "adamw", compile_=True, graphs=False, document_mask=DOCUMENT_MASK_TOKEN)
                    if flags.get("attention_flex"):
                        # the same attention by FlexAttention's block-sparse kernel: key blocks
                        # wholly in earlier documents skipped, not computed and masked
                        ours(mdl, seq, "adamw", compile_=True, graphs=False, document_mask=DOCUMENT_MASK_TOKEN,
                             attention="flex")
                if primary and flags["compile"]:
                    if cpu_eager:
                        if (mdl, seq) == first:
                            ours(mdl, seq, "adamw", compile_=True, cpu_compile_anyway=True)
                    else:
                        ours(mdl, seq, "adamw", compile_=False)
                hf(mdl, seq, "adamw", True)
                if (mdl, seq) == first or (not compile_ok and primary):  # eager HF and Muon: one point on the
                    hf(mdl, seq, "adamw", False)                          # GPU (torch.compile of the whole HF
                    ours(mdl, seq, "muon", compile_=main_compile)         # model costs ~60 s per shape there)
                    hf(mdl, seq, "muon", True)
                    if not compile_ok:
                        hf(mdl, seq, "muon", False)
                if primary:
                    two_bw(mdl, seq, "adamw")
    mdl, seq = first
    if importlib.util.find_spec("torchtitan") is None:
        skipped.append(("torchtitan", "not installed"))
    else:
        rows.append(row(f"torchtitan {'compile' if compile_ok else 'eager'} adamw", "torchtitan", mdl, seq,
                        mb_at[seq], m, optimizer="adamw", compile=compile_ok))
    head = SMOKE_HEAD_SHAPE if args.mode == "smoke" else HEAD_SHAPE
    if args.mode != "smoke" or args.smoke_head:  # the suite measures the smoke's head rows in-process
        # "fused@N": the fused head with N rows per chunk (--head-chunk-rows), named "fused N rows"
        modes = ["plain", "fused", *(f"fused@{n}" for n in getattr(args, "head_chunk_rows", []))]
        for mode in modes:
            name = f"head-loss {mode.replace('@', ' ')}" + (" rows" if "@" in mode else "")
            rows.append(row(name, "head", "head C={n_embd} V={vocab}".format(**head), head["seq"],
                            head["batch"], 1, head_mode=mode, head_modes=modes, head_shape=head))
    def named(r):
        return f"{r['name']} {r['model']} T={r['seq_len']}"
    if args.only:
        keep = [s.strip() for s in args.only.split(",") if s.strip()]
        rows = [r for r in rows if any(k in named(r) for k in keep)]
        if not rows:  # a mistyped name would run nothing and write an empty report
            raise BenchError(f"--only {args.only}: no row's 'name model T=seq' holds any of these; --dry-run "
                             "lists the rows")
    if args.skip:
        drop = [s.strip() for s in args.skip.split(",") if s.strip()]
        rows = [r for r in rows if not any(k in named(r) for k in drop)]
    return rows, skipped

