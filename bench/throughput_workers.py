"""The rows bench/gpu_throughput.py measures in a worker process of their own
(``gpu_throughput.py --worker SPEC``, started by throughput_rows.run_worker_row): the Hugging Face
training loop (torchtitan's Llama runs in the same loop) and the head-loss pair. A worker prints one
RESULT_TAG line: the row's figures, or its status (oom / error) and a one-line reason."""
from __future__ import annotations

import importlib
import json
import math
import os
import resource
import time

from row_process import GATE_ENV, OFFLINE_ENV, wait_for_turn
from throughput_rows import RESULT_TAG


def _result(payload: dict) -> None:
    print(RESULT_TAG + json.dumps(payload), flush=True)


def _is_oom(exc: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def worker_main(spec: dict) -> int:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    try:
        payload = worker_head(spec) if spec["kind"] == "head" else worker_train(spec)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the row's status
        if isinstance(exc, KeyboardInterrupt):
            raise
        status = "oom" if _is_oom(exc) else "error"
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        payload = dict(status=status, error=msg)
    _result(payload)
    return 0


def _turn() -> None:
    """Started ahead of its turn (GATE_ENV): everything up to here overlapped the row before."""
    if os.environ.get(GATE_ENV):
        wait_for_turn()


def _peak(device) -> tuple:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "alloc"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def build_hf_model(spec: dict):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**spec["hf_config"])
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    if spec["shape"]["tie_embeddings"] and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("LlamaForCausalLM did not tie the head to the embedding")
    info = dict(transformers=transformers.__version__, attn_implementation=model.config._attn_implementation)

    def forward(x):
        return model(input_ids=x, use_cache=False).logits
    return model, forward, info


def build_torchtitan_model(spec: dict):
    """torchtitan's Llama (its own model code) at the bench's shape; best effort across releases."""
    import torchtitan

    s = spec["shape"]
    candidates = [("torchtitan.models.llama3", "TransformerModelArgs", "Transformer"),
                  ("torchtitan.models.llama3.model.args", "TransformerModelArgs", None),
                  ("torchtitan.models.llama", "ModelArgs", "Transformer")]
    args_cls = model_cls = None
    for mod_name, args_name, cls_name in candidates:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        args_cls = getattr(mod, args_name, None) or args_cls
        model_cls = getattr(mod, cls_name, None) if cls_name else model_cls
        if model_cls is None and args_cls is not None:
            try:
                model_cls = importlib.import_module("torchtitan.models.llama3.model.model").Transformer
            except (ImportError, AttributeError):
                pass
        if args_cls is not None and model_cls is not None:
            break
    if args_cls is None or model_cls is None:
        raise RuntimeError("torchtitan is installed but its Llama model classes were not found")
    # torchtitan's SwiGLU width: 2/3 * 4C rounded up to multiple_of (1536 for C=576, 2560 for C=960).
    margs = args_cls(dim=s["n_embd"], n_layers=s["n_layer"], n_heads=s["n_head"], n_kv_heads=s["n_kv_head"],
                     vocab_size=s["vocab_size"], multiple_of=256, norm_eps=s["norm_eps"], rope_theta=s["rope_theta"],
                     max_seq_len=spec["seq_len"])
    model = model_cls(margs)
    if hasattr(model, "init_weights"):
        model.init_weights()
    ffn = [m for n, m in model.named_modules() if n.endswith("feed_forward")]
    width = ffn[0].w1.out_features if ffn and hasattr(ffn[0], "w1") else None
    info = dict(torchtitan=getattr(torchtitan, "__version__", "?"), ffn_width=width,
                note="untied output layer" if hasattr(model, "output") else "")

    def forward(x):
        return model(x)
    return model, forward, info


def make_optimizer(model, name: str, device):
    import torch

    fused = dict(fused=True)
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, **fused)]
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch.optim.Muon needs torch >= 2.9 (this is {torch.__version__})")
    embed_like = ("embed", "lm_head", "tok_embeddings", "output")
    matrices, rest = [], []
    for n, p in model.named_parameters():
        (matrices if p.ndim == 2 and not any(k in n for k in embed_like) else rest).append(p)
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0, momentum=0.95),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0, **fused)]


def worker_train(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from asyncpp_ext.data.batches import BatchStream, split_tokens
    from asyncpp_ext.data.sources import builtin_corpus
    from asyncpp_ext.training.config import RunConfig

    device = torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    import torch._dynamo  # noqa: F401 -- before the turn: the optimizer's creation imports it
    if spec["compile"]:
        import torch._inductor.compile_fx  # noqa: F401 -- torch.compile's imports
    # The model on the CPU, and the same training windows as asyncpp-train --data builtin --seed 0
    # (its train split): none of it needs the device, all of it may run ahead of the row's turn.
    if spec["kind"] == "hf":
        model, forward, info = build_hf_model(spec)
    else:
        model, forward, info = build_torchtitan_model(spec)
    b, m, t = spec["micro_batch_size"], spec["microbatches"], spec["seq_len"]
    train, _ = split_tokens(builtin_corpus(), RunConfig().data.eval_fraction, b, t, source="builtin")
    stream = BatchStream(train, m, b, t, seed=spec["seed"])
    _turn()
    model.to(device).train()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    opts = make_optimizer(model, spec["optimizer"], device)
    vocab = spec["shape"]["vocab_size"]
    amp = torch.bfloat16 if spec["dtype"] == "bf16" else None

    def fwd_loss(x, y):
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = forward(x)
        return F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))

    step_fn = torch.compile(fwd_loss) if spec["compile"] else fwd_loss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    def train_step() -> float:
        total = torch.zeros((), device=device)
        for x, y in stream.next():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = step_fn(x, y)
            (loss / m).backward()
            total += loss.detach()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        return total.item() / m  # the host waits for the step here

    losses, elapsed, tokens = [], [], []
    first, last = spec.get("trace_steps") or (0, -1)  # optional: trace steps first..last (from 1) to trace_path
    start, clock_start = time.perf_counter(), time.time()  # the steps' clock, on the wall clock too
    for step in range(spec["steps"]):
        if step + 1 == first:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        losses.append(train_step())
        elapsed.append(round(time.perf_counter() - start, 4))
        tokens.append((step + 1) * b * m * t)
        if step + 1 == last:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(spec["trace_path"])
    peak, kind = _peak(device)
    out = dict(status="ok", losses=[v if math.isfinite(v) else None for v in losses], elapsed_s=elapsed,
               tokens=tokens, peak_bytes=peak, peak_kind=kind, params=params, info=info, torch=torch.__version__,
               clock_start=clock_start)
    if spec.get("profile"):  # --profile: that many more steps traced, after the measured ones, as for ours' rows
        out["profile"] = {spec["kind"]: _profile_steps(train_step, spec["profile"], device)}
    return out


def _profile_steps(train_step, steps: int, device) -> dict:
    """``steps`` calls of ``train_step`` traced (the device's kernels too on CUDA), per step
    (throughput_rows.per_step_profile): which kernels the model's step runs -- its attention kernel
    among them -- and where the device sat idle."""
    from asyncpp_ext.training.profiling import trace_calls
    from throughput_rows import per_step_profile

    return per_step_profile(trace_calls(train_step, steps, device), steps)


def _profile_head(mode: str, spec: dict, device, dtype) -> dict:
    """Kernel time by kind, kernel count and the costliest kernels of the head's forward + backward
    on a GPU (asyncpp_ext.training.profiling's summary of a torch.profiler trace). The traced
    ``measure_head_loss`` call runs the head twice (warm-up, one timed call): figures per call are halves.
    (On CPU ``measure_head_loss`` runs a profiler of its own for the peak memory: not traced.)"""
    from asyncpp_ext.models.head_loss import measure_head_loss
    from asyncpp_ext.training.profiling import trace_calls

    name, kw = head_mode(mode)
    s = trace_calls(lambda: measure_head_loss(name, spec["batch"], spec["seq"], spec["n_embd"], spec["vocab"],
                                              device, dtype, repeats=1, **kw), 1, device)
    return {"kernels_per_call": s["kernels"] // 2,
            "device_ms_per_call": {k: round(v / 2, 3) for k, v in s["device_ms_by_kind"].items()},
            "top_kernels_per_call": [dict(k, ms=round(k["ms"] / 2, 3), launches=k["launches"] // 2)
                                     for k in s["top_kernels"][:8]]}


def head_mode(mode: str) -> tuple:
    """A head row's mode -> (measure_head_loss's mode, its chunk_rows keyword): "fused@N" is the
    fused head with N rows per chunk."""
    name, _, rows = mode.partition("@")
    return (name, {"chunk_rows": int(rows)} if rows else {})


def worker_head(spec: dict) -> dict:
    import torch

    from asyncpp_ext.models.head_loss import measure_head_loss

    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    if device.type == "cuda":
        import torch._inductor.compile_fx  # noqa: F401 -- the fused head's compile imports, before the turn
    _turn()
    clock_start = time.time()
    modes = {}
    for mode in spec["modes"]:  # measure_head_loss measures each call's own peak
        try:
            name, kw = head_mode(mode)
            out = measure_head_loss(name, spec["batch"], spec["seq"], spec["n_embd"], spec["vocab"], device, dtype, **kw)
            modes[mode] = dict(status="ok", head_seconds=float(out["seconds"]), peak_bytes=int(out["peak_bytes"]),
                               head_loss=float(out["loss"]), peak_kind="measure_head_loss", dtype=spec["dtype"])
            if spec.get("profile") and device.type == "cuda":  # where the head's GPU time goes, by kernel
                modes[mode]["profile"] = _profile_head(mode, spec, device, dtype)
        except Exception as exc:  # noqa: BLE001 - the mode's row fails, the other still runs
            modes[mode] = dict(status="oom" if _is_oom(exc) else "error",
                               error=" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return dict(status="ok", modes=modes, clock_start=clock_start, clock_end=time.time())
