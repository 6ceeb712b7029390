"""``asyncpp-train``: train the GPT with a pipeline schedule, or simulate that schedule in one process.

With no arguments it trains the tiny GPT on the built-in corpus for a few seconds. Outputs in the
run directory (--out): metrics.jsonl (one JSON row per step), config.json, loss.png and checkpoints
ckpt-NNNNNN/ (every --ckpt-every steps and at the end). ``--resume DIR`` continues DIR's run from its
latest checkpoint exactly as if it had never stopped.

Every bad input ends with one line ``asyncpp-train: error: ...`` on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from .checkpoint import (CheckpointError, NonFiniteCheckpointError, check_resume_config, latest_checkpoint, load_checkpoint,
                         read_meta, restore_rng_state)
from .config import (DTYPES, LR_SCHEDULES, MUON_FAMILY, NONFINITE_POLICIES, NS_DTYPES, EF_BETA_AUTO, LR_AUTO, OPTIMIZERS,
                     SCHEDULES, TRANSPORTS, ConfigError, RunConfig)
from ..data import DataError
from ..models.registry import MODEL_PRESETS, build_model, describe
from .model_source import ModelSourceError, model_from_args
from .simulate import DelaySimulator, merge_engine_states
from ..optim import build_optimizer
from ..optim._kernels import cpu_kernel_isa
from ..optim.mitigations import DEFAULT_DC_LAMBDA, MITIGATIONS
from ..optim.versioned import EF_SOURCES
from ..optim.newton_schulz import bf16_matmul_choice
from ..pipeline import LaunchError, under_launcher
from ..pipeline.nonfinite import NonFiniteError
from .trainer import (CONFIG_NAME, METRICS_NAME, Trainer, read_metrics, run_data, truncate_metrics,
                      write_text_atomic)

PROG = "asyncpp-train"
OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
_D = RunConfig()  # the documented defaults


class UsageError(ValueError):
    """Bad command line (argparse's complaints, conflicting flags, unusable --out)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: the caller prints it
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    # Defaults are None so that the flags a user typed can be told apart (needed by --resume,
    # which takes every unset value from the checkpoint); the real defaults are shown in help.
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe, opt, run = (p.add_argument_group(t) for t in ("pipeline", "optimizer", "run"))
    pipe.add_argument("--schedule", choices=SCHEDULES,
                      help=f"sync|gpipe|1f1b: no delay; 2bw: one-step weight delay, no flush; pipedream: "
                           f"one microbatch per step, stage s delayed S-1-s steps (default {_D.pipeline.schedule})")
    pipe.add_argument("--delay", type=int, metavar="K",
                      help="with --schedule 2bw --simulate: a constant K-step weight delay instead of 2bw's one "
                           "(research knob)")
    pipe.add_argument("--stages", type=int, help=f"pipeline stages (default {_D.pipeline.stages})")
    pipe.add_argument("--microbatches", type=int,
                      help=f"microbatches per step; 2bw needs >= stages (default {_D.pipeline.microbatches})")
    pipe.add_argument("--micro-batch-size", type=int,
                      help=f"sequences per microbatch per replica (default {_D.pipeline.micro_batch_size})")
    pipe.add_argument("--dp", type=int,
                      help="data-parallel replicas of the pipeline; stages x dp processes, each step "
                           "takes microbatches x dp x micro-batch-size sequences (default 1)")
    pipe.add_argument("--no-shard-muon", action="store_true", default=None,
                      help="with --dp > 1, every replica runs all Muon orthogonalisations itself "
                           "(default: each runs a share and they are gathered)")
    pipe.add_argument("--transport", choices=TRANSPORTS,
                      help="how stage processes exchange activations and gradients: auto (nccl on "
                           "cuda, gloo on cpu), nccl (C++ NCCL, one GPU per rank), torch "
                           "(torch.distributed p2p: NCCL on cuda, one GPU per rank; gloo on cpu), "
                           "gloo (on cuda via host copies: ranks may share a GPU) (default auto)")
    pipe.add_argument("--recompute", action="store_true", default=None,
                      help="recompute each stage's forward before its backward: same losses, less "
                           "activation memory")
    # No argparse choices= for names other engineers' lists grow: the config names the valid ones.
    opt.add_argument("--optimizer", metavar="NAME",
                     help=f"{'|'.join(OPTIMIZERS)} (default {_D.optim.name})")
    opt.add_argument("--lr", type=float, help="learning rate (default per optimizer: " + ", ".join(
        f"{k} {v:g}" for k, v in LR_AUTO.items()) + ")")
    opt.add_argument("--adamw-lr", type=float,
                     help="lr of muon's AdamW part (embeddings, head, norms, biases); default 3e-3")
    opt.add_argument("--weight-decay", type=float, help=f"default {_D.optim.weight_decay}")
    opt.add_argument("--ef-beta", type=float,
                     help="error-feedback delay correction strength, 0 = off (default auto: "
                          + ", ".join(f"{k} {v:g}" for k, v in EF_BETA_AUTO.items()) + ")")
    opt.add_argument("--ef-source", metavar="SOURCE",
                     help=f"{'|'.join(EF_SOURCES)}: error feedback's previous update from a buffer of its own, "
                          "or from the weight versions of a delayed schedule (no extra memory) (default buffer)")
    opt.add_argument("--mitigation", metavar="NAME",
                     help=f"{'|'.join(MITIGATIONS)}: staleness mitigation; ef = error feedback (--ef-beta), "
                          "predict = forward/backward on extrapolated weights (--simulate only), dc = delay "
                          "compensation of the gradient (--dc-lambda), lr-rescale = lr times (1+d)^-p(t) over "
                          "--rescale-steps (default: ef when --ef-beta resolves > 0, else none)")
    opt.add_argument("--dc-lambda", type=float, metavar="X",
                     help=f"strength of --mitigation dc (default {DEFAULT_DC_LAMBDA:g}, DC-ASGD's constant)")
    opt.add_argument("--rescale-steps", type=int, metavar="K",
                     help="--mitigation lr-rescale: steps over which the lr reduction fades out "
                          "(default max(1, steps // 10))")
    opt.add_argument("--muon-momentum", type=float, metavar="MU",
                     help=f"momentum of the muon/normuon matrices (default {_D.optim.muon_momentum:g})")
    opt.add_argument("--ns-dtype", choices=NS_DTYPES,
                     help="muon's Newton-Schulz dtype: auto = bf16 on CUDA, fp32 on CPU (default auto)")
    run.add_argument("--steps", type=int, help=f"total optimizer steps (default {_D.train.steps})")
    run.add_argument("--seed", type=int, help=f"init and batch-order seed (default {_D.train.seed})")
    opt.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                     help="lr multiplier over the run: constant, cosine (down to --min-lr-ratio at the "
                          "end) or wsd (warmup, stable, linear decay over --decay-steps) (default constant)")
    opt.add_argument("--warmup-steps", type=int, help="linear lr warmup steps (default 0)")
    opt.add_argument("--decay-steps", type=int, help="wsd: steps of the final decay (default: a share of --steps)")
    opt.add_argument("--min-lr-ratio", type=float, help="cosine/wsd: final lr as a fraction of --lr")
    opt.add_argument("--clip-grad-norm", type=float, metavar="X",
                     help="clip the gradient to global norm X, measured on the previous step's gradient so "
                          "no stage waits for the others (default: no clipping)")
    model = p.add_argument_group("model and data")
    model.add_argument("--data", help="'builtin' (Python's standard library source), a UTF-8 text "
                                      "file, or a .bin token file (uint16 nanoGPT format, or written by "
                                      "asyncpp-prepare-data) (default builtin)")
    model.add_argument("--val-data", metavar="FILE",
                       help="evaluate on this file (same formats as --data) instead of the end of --data")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS),
                       help="preset: tiny (gpt, 2 layers, width 32), small (gpt, 4 x 128), llama-tiny, "
                            "smollm-135m, smollm-360m (default tiny)")
    model.add_argument("--hf-config", metavar="FILE",
                       help="a Hugging Face config.json (Llama family or GPT-2): that model, randomly "
                            "initialised (needs pip install 'asyncpp_ext[hf]')")
    model.add_argument("--hf-model", metavar="DIR",
                       help="a local Hugging Face model directory (config.json + safetensors) to continue "
                            "pretraining from")
    for flag in ("n-layer", "n-embd", "n-head", "seq-len"):
        model.add_argument(f"--{flag}", type=int, help="override the preset's value")
    model.add_argument("--vocab-size", type=int,
                       help="token ids the model knows (default: the model's; data ids must be below it)")
    run.add_argument("--eval-every", type=int,
                     help=f"eval every K steps and at the end, 0 = end only (default {_D.train.eval_every})")
    run.add_argument("--ckpt-every", type=int,
                     help=f"checkpoint every K steps and at the end, 0 = end only (default {_D.train.ckpt_every})")
    run.add_argument("--out", help="run directory (default runs/YYYYmmdd-HHMMSS; with --resume, "
                                   "the resumed directory)")
    run.add_argument("--resume", metavar="DIR",
                     help="continue DIR's run from its latest checkpoint up to --steps; flags "
                          "left out are taken from the checkpoint")
    run.add_argument("--device", choices=("cpu", "cuda"), help="default cpu")
    run.add_argument("--dtype", choices=DTYPES,
                     help="auto: bf16 autocast on cuda, fp32 on cpu; bf16: autocast with fp32 "
                          "weights and optimizer state (slow on cpu) (default auto)")
    run.add_argument("--simulate", action="store_true", default=None,
                     help="run the schedule's update rule in one process (delay simulator)")
    run.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
    run.add_argument("--timeout", type=float, metavar="SECONDS",
                     help=f"abort every rank with a report when no pipeline instruction completes "
                          f"for this long (default {_D.train.timeout_s:g}, or $ASYNCPP_TIMEOUT)")
    run.add_argument("--threads", type=int, metavar="N",
                     help="intra-op threads per process (default: cores / (stages x dp) for each rank "
                          "of a multi-process run, torch's default for one process); runs match "
                          "bitwise only at equal counts")
    run.add_argument("--tensorboard", action="store_true", default=None,
                     help="also write TensorBoard events to OUT/tensorboard (pip install "
                          "'asyncpp_ext[tensorboard]')")
    run.add_argument("--on-nonfinite", choices=NONFINITE_POLICIES,
                     help="NaN/Inf loss or gradient: stop the run, or skip that step's update on "
                          f"every stage (default {_D.train.on_nonfinite})")
    return p


def config_from_args(args: argparse.Namespace, base: Optional[RunConfig] = None) -> RunConfig:
    """``base`` (defaults, or a resumed run's config) with every flag the user gave applied."""
    cfg = RunConfig.from_dict((base or RunConfig()).to_dict())  # a private copy
    cfg.model = model_from_args(args, cfg.model)
    sets = {
        ("pipeline", "schedule"): args.schedule, ("pipeline", "stages"): args.stages,
        ("pipeline", "delay"): args.delay,
        ("pipeline", "microbatches"): args.microbatches,
        ("pipeline", "micro_batch_size"): args.micro_batch_size, ("pipeline", "dp"): args.dp,
        ("pipeline", "shard_muon"): None if args.no_shard_muon is None else not args.no_shard_muon,
        ("pipeline", "recompute"): args.recompute, ("pipeline", "transport"): args.transport,
        ("train", "dtype"): args.dtype,
        ("optim", "name"): args.optimizer, ("optim", "lr"): args.lr,
        ("optim", "adamw_lr"): args.adamw_lr, ("optim", "weight_decay"): args.weight_decay,
        ("optim", "ef_beta"): args.ef_beta, ("optim", "ns_dtype"): args.ns_dtype, ("train", "steps"): args.steps,
        ("optim", "ef_source"): args.ef_source, ("optim", "mitigation"): args.mitigation,
        ("optim", "dc_lambda"): args.dc_lambda, ("optim", "rescale_steps"): args.rescale_steps,
        ("optim", "muon_momentum"): args.muon_momentum,
        ("optim", "lr_schedule"): args.lr_schedule, ("optim", "warmup_steps"): args.warmup_steps,
        ("optim", "decay_steps"): args.decay_steps, ("optim", "min_lr_ratio"): args.min_lr_ratio,
        ("optim", "clip_grad_norm"): args.clip_grad_norm, ("train", "tensorboard"): args.tensorboard,
        ("train", "seed"): args.seed, ("data", "source"): args.data, ("data", "val_source"): args.val_data,
        ("train", "eval_every"): args.eval_every, ("train", "ckpt_every"): args.ckpt_every,
        ("train", "out"): args.out, ("train", "device"): args.device,
        ("train", "simulate"): args.simulate,
        ("train", "progress"): None if args.no_progress is None else not args.no_progress,
        ("train", "timeout_s"): args.timeout if args.timeout is not None else _env_timeout(),
        ("train", "on_nonfinite"): args.on_nonfinite, ("train", "threads"): args.threads,
    }
    for (section, name), value in sets.items():
        if value is not None:
            setattr(getattr(cfg, section), name, value)
    cfg.train.resume = args.resume
    return cfg


def _env_timeout() -> Optional[float]:
    """ASYNCPP_TIMEOUT when set (it overrides the default and a resumed run's saved value)."""
    from ..pipeline.watchdog import TIMEOUT_ENV, default_timeout_s

    if not os.environ.get(TIMEOUT_ENV, "").strip():
        return None
    try:
        return default_timeout_s()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def make_optimizer_factory(cfg: RunConfig) -> OptimizerFactory:
    """``(module) -> optimizer`` for cfg.optim (a whole model or one pipeline stage's blocks)."""
    o = cfg.optim
    extra = {}
    if o.name in MUON_FAMILY:
        extra.update(adamw_lr=o.effective_adamw_lr(), ns_dtype=o.ns_torch_dtype(), momentum=o.muon_momentum)
    return lambda module: build_optimizer(module, o.name, o.effective_lr(), weight_decay=o.weight_decay,
                                          ef_beta=o.effective_ef_beta(), ef_source=o.ef_source, **extra)


def run_pipeline(cfg: RunConfig, resume_dir: Optional[Path] = None) -> int:
    """Multi-process pipeline training: one process per stage (spawned here, or torchrun's)."""
    from .distributed import launch

    # Every check that can fail on bad input happens before any process starts.
    run_data(cfg)
    start_step = 0
    if resume_dir is not None:
        meta, _ = load_checkpoint(resume_dir)  # verifies every shard
        start_step = int(meta["step"])

    def prepare() -> None:
        out = _prepare_run_dir(cfg, resuming=resume_dir is not None)
        if resume_dir is not None:
            truncate_metrics(out, start_step)
        write_text_atomic(out / CONFIG_NAME, json.dumps(cfg.to_dict(), indent=1) + "\n")

    launch(cfg, resume_dir, make_optimizer_factory, prepare)
    if not under_launcher() or os.environ.get("RANK") == "0":
        _print_summary(Path(cfg.train.out), cfg, start_step)
    return 0


def _print_summary(out: Path, cfg: RunConfig, start_step: int) -> None:
    rows = [r for r in read_metrics(out) if r["step"] > start_step]
    if not rows:
        print(f"{out}: already at step {start_step} of {cfg.train.steps}; nothing to do")
        return
    last = rows[-1]
    shown = f" eval_loss {last['eval_loss']:.4f}" if "eval_loss" in last else ""
    skipped = sum(1 for r in rows if r.get("skipped"))
    shown += f" ({skipped} step{'s' if skipped != 1 else ''} skipped: non-finite values)" if skipped else ""
    loss = "skipped" if last["loss"] is None else f"{last['loss']:.4f}"
    print(f"{out}: step {last['step']} loss {loss}{shown} "
          f"({last['elapsed_s']:.1f} s, {describe(cfg.model)}, {cfg.pipeline.schedule}, {cfg.optim.name}, "
          f"{cfg.pipeline.stages} stage{'s' if cfg.pipeline.stages > 1 else ''}"
          f"{f' x {cfg.pipeline.dp} replicas' if cfg.pipeline.dp > 1 else ''})")


def _prepare_run_dir(cfg: RunConfig, resuming: bool) -> Path:
    """Create (or check) the run directory only after every other check passed."""
    out = Path(cfg.train.out)
    if not resuming and out.exists() and ((out / METRICS_NAME).exists() or any(out.glob("ckpt-*"))):
        raise UsageError(f"--out {out} already holds a run; continue it with --resume {out} or "
                         "choose another --out")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        if created and out.is_dir():
            out.rmdir()
        raise UsageError(f"cannot write to --out {out} ({exc.strerror or exc}); choose a "
                         "writable directory") from None
    return out


def run_single_process(cfg: RunConfig, resume_dir: Optional[Path] = None) -> int:
    """Simulated (or single-stage) training: the DelaySimulator under the shared Trainer."""
    threads = torch.get_num_threads()
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)
    try:
        return _run_single_process(cfg, resume_dir)
    finally:  # main() may be called as a library function: leave the caller's setting as it was
        torch.set_num_threads(threads)


def _run_single_process(cfg: RunConfig, resume_dir: Optional[Path]) -> int:
    factory = make_optimizer_factory(cfg)
    p = cfg.pipeline
    stream, eval_set = run_data(cfg)  # --dp R simulates one replica on the global microbatches
    model = build_model(cfg.model, seed=cfg.train.seed).to(cfg.train.device)
    engine = DelaySimulator(model, factory(model), p.schedule, on_nonfinite=cfg.train.on_nonfinite,
                            loss_fn=autocast_loss(cfg.train.dtype, torch.device(cfg.train.device)),
                            lr_schedule=cfg.lr_schedule(), clip_grad_norm=cfg.optim.clip_grad_norm,
                            stages=p.stages, delay=p.delay, **cfg.mitigation_kwargs())
    start_step, elapsed = 0, 0.0
    if resume_dir is not None:
        meta, shards = load_checkpoint(resume_dir)
        try:
            engine.load_state_dict(merge_engine_states([s["engine"] for s in shards]))
            stream.load_state_dict(meta["data"])
        except (KeyError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint {resume_dir} does not fit this run "
                                  f"({str(exc).splitlines()[0]})") from None
        start_step, elapsed = int(meta["step"]), float(meta.get("elapsed_s", 0.0))
    out = _prepare_run_dir(cfg, resuming=resume_dir is not None)
    if resume_dir is not None:
        truncate_metrics(out, start_step)
        restore_rng_state(shards[0]["rng"])
    write_text_atomic(out / CONFIG_NAME, json.dumps(cfg.to_dict(), indent=1) + "\n")
    trainer = Trainer(cfg, engine, stream, eval_set, out, start_step=start_step,
                      elapsed_s=elapsed, device=cfg.train.device)
    trainer.run()
    _print_summary(out, cfg, start_step)
    return 0


def autocast_loss(dtype: str, device: torch.device):
    """The simulator's loss function under the run's --dtype (bf16 autocast or plain fp32)."""
    from ..pipeline.recompute import autocast_context, resolve_autocast
    from .simulate import default_loss

    autocast_dtype = resolve_autocast(dtype, device)

    def loss(model, inputs, targets):
        with autocast_context(device, autocast_dtype):
            return default_loss(model, inputs, targets)
    return loss


def runs_multi_process(cfg: RunConfig) -> bool:
    """A pipeline or data-parallel run that is not simulated: one process per stage and replica."""
    return cfg.runs_multi_process()


def _resolve(argv) -> tuple[RunConfig, Optional[Path]]:
    args = build_parser().parse_args(argv)
    resume_dir = None
    if args.resume is not None:
        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise UsageError(f"--resume {run_dir} is not a directory; pass the --out directory "
                             "of an earlier run")
        if args.out is not None and Path(args.out).resolve() != run_dir.resolve():
            raise UsageError(f"--out {args.out} differs from --resume {args.resume}; a resumed "
                             "run continues in its own directory, drop --out")
        resume_dir = latest_checkpoint(run_dir)
        meta = read_meta(resume_dir)  # shards are verified when they are loaded
        try:
            saved = RunConfig.from_dict(meta["config"])
        except (ConfigError, TypeError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {resume_dir} holds an unusable config ({exc})") from None
        cfg = config_from_args(args, base=saved)
        cfg.train.out = str(run_dir)
        check_resume_config(resume_dir, meta["config"], cfg)
        if cfg.train.steps < meta["step"]:
            raise UsageError(f"--steps {cfg.train.steps} is before the checkpoint's step "
                             f"{meta['step']} in {resume_dir}; pass --steps >= {meta['step']}")
    else:
        cfg = config_from_args(args)
        if args.out is None and under_launcher():
            raise UsageError("under torchrun pass --out DIR: every rank must write to the same run "
                             "directory")
        if args.out is None:
            cfg.train.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    cfg.validate()
    cfg.optim.pin_auto_values(cfg.train.steps)  # a resumed run reads the numbers back (older checkpoints: None)
    if cfg.train.tensorboard:
        from .tensorboard_log import TensorboardUnavailableError, require_tensorboard
        try:
            require_tensorboard()
        except TensorboardUnavailableError as exc:
            raise UsageError(str(exc)) from None
    try:  # the CPU-path variables fail here, not inside a rank after the run has started
        bf16_matmul_choice()
        cpu_kernel_isa()  # spawned ranks read $ASYNCPP_CPU_ISA afresh; this process too, if no kernel ran yet
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if runs_multi_process(cfg) and cfg.pipeline.schedule == "sync":
        raise UsageError(f"--schedule sync is the one-process reference rule; a run with --stages "
                         f"{cfg.pipeline.stages} --dp {cfg.pipeline.dp} needs a pipeline schedule: "
                         "gpipe or 1f1b (the same update rule), or 2bw; or add --simulate")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA GPU is visible; use --device cpu")
    if runs_multi_process(cfg):
        check_rank_devices(cfg)
    return cfg, resume_dir


def check_rank_devices(cfg: RunConfig) -> None:
    """Before any rank starts: this machine's ranks can each get the device and transport asked for."""
    from ..pipeline.devices import DeviceError, check_local_world, choose_transport, local_world_size

    try:
        transport = choose_transport(cfg.pipeline.transport, cfg.train.device)
        if cfg.train.device != "cuda":
            return
        launcher = "torchrun" if under_launcher() else "spawn"
        local_world = local_world_size(launcher, cfg.pipeline.stages * cfg.pipeline.dp, os.environ)
        check_local_world(local_world, torch.cuda.device_count(), transport, launcher)
    except DeviceError as exc:
        raise UsageError(str(exc)) from None
    if transport == "nccl":
        from ..pipeline.nccl import NcclUnavailableError, require_nccl
        try:
            require_nccl(need_gpu=True)
        except NcclUnavailableError as exc:
            via = "" if cfg.pipeline.transport == "nccl" else " (auto picks nccl on cuda; --transport gloo avoids it)"
            raise UsageError(f"--transport nccl{via}: {exc}") from None
    if transport == "torch":
        import torch.distributed as dist
        if not dist.is_nccl_available():
            raise UsageError("--transport torch on cuda needs torch.distributed's NCCL backend, which this "
                             "torch build lacks; use --transport nccl or gloo")


# Config fields and the flag that sets each, so a config complaint can name what to type.
FIELD_FLAGS = {
    "pipeline.schedule": "--schedule", "pipeline.stages": "--stages",
    "pipeline.microbatches": "--microbatches", "pipeline.micro_batch_size": "--micro-batch-size",
    "pipeline.dp": "--dp", "pipeline.transport": "--transport", "train.dtype": "--dtype",
    "pipeline.delay": "--delay", "model.tie_embeddings": "--model",
    "optim.name": "--optimizer", "optim.lr": "--lr", "optim.adamw_lr": "--adamw-lr",
    "optim.weight_decay": "--weight-decay", "optim.ef_beta": "--ef-beta", "optim.ns_dtype": "--ns-dtype",
    "train.steps": "--steps", "train.seed": "--seed", "train.eval_every": "--eval-every",
    "train.ckpt_every": "--ckpt-every", "train.device": "--device", "train.timeout_s": "--timeout",
    "train.on_nonfinite": "--on-nonfinite", "train.threads": "--threads", "model.n_layer": "--n-layer",
    "model.n_embd": "--n-embd", "model.n_head": "--n-head", "model.seq_len": "--seq-len",
    "model.vocab_size": "--vocab-size", "optim.clip_grad_norm": "--clip-grad-norm",
    "optim.warmup_steps": "--warmup-steps", "optim.decay_steps": "--decay-steps",
    "optim.min_lr_ratio": "--min-lr-ratio", "optim.lr_schedule": "--lr-schedule",
    "optim.ef_source": "--ef-source", "optim.mitigation": "--mitigation", "optim.dc_lambda": "--dc-lambda",
    "optim.rescale_steps": "--rescale-steps", "optim.muon_momentum": "--muon-momentum",
}


def _name_flag(message: str) -> str:
    """Prefix a config complaint with the flag that sets the field it starts with."""
    for name in sorted(FIELD_FLAGS, key=len, reverse=True):  # optim.lr_schedule before optim.lr
        if message.startswith(name):
            return f"{FIELD_FLAGS[name]}: {message}"
    return message


def main(argv=None) -> int:
    cfg = None
    try:
        cfg, resume_dir = _resolve(argv)
        if runs_multi_process(cfg):
            return run_pipeline(cfg, resume_dir)
        return run_single_process(cfg, resume_dir)
    except (NonFiniteError, NonFiniteCheckpointError) as exc:  # a run failure, not a bad input
        sys.stderr.write(f"{PROG}: error: {' '.join(str(exc).split())}\n")
        return 1
    except KeyboardInterrupt:
        where = f"; continue with --resume {cfg.train.out}" if cfg is not None else ""
        sys.stderr.write(f"\n{PROG}: interrupted{where}\n")
        return 130
    except (UsageError, ConfigError, DataError, CheckpointError, ModelSourceError) as exc:
        message = " ".join(str(exc).split())  # exactly one line
        if isinstance(exc, ConfigError):
            message = _name_flag(message)
        sys.stderr.write(f"{PROG}: error: {message}\n")
        return 2
    except LaunchError as exc:  # each rank has already printed its own line
        sys.stderr.write(f"{PROG}: error: the pipeline run failed: {exc}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
