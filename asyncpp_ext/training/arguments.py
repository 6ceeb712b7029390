"""The flags of ``asyncpp-train`` and how they become a ``RunConfig``: the parser, the mapping of
flags onto config fields (and back, so a config complaint can name the flag to type)."""
from __future__ import annotations

import argparse
import os
from typing import Optional

from ..command_line import OneLineParser, UsageError
from ..models.attention import ATTENTION_BACKENDS
from .config import (COMPILE_MODES, COMPILE_SCOPES, DECAY_SHAPES, DELAY_ONLY, DTYPES, HEAD_LOSSES, LR_SCHEDULES, NONFINITE_CHECKS, NONFINITE_POLICIES, NS_DTYPES, EF_BETA_AUTO, LR_AUTO, OPTIMIZERS,
                     SCHEDULES, TRANSPORTS, ConfigError, RunConfig)
from ..data.batches import SAMPLINGS
from ..models.registry import MODEL_PRESETS
from .flag_values import (_inductor_options, data_mix_entry, document_mask_value, inductor_option, steps_for_tokens,
                          token_count)
from .model_source import model_from_args
from ..optim.mitigations import DEFAULT_DC_LAMBDA, MITIGATIONS
from ..optim.registry import MUON_ADAMW_LR
from ..optim.versioned import EF_SOURCES

PROG = "asyncpp-train"
_D = RunConfig()  # the documented defaults
COMPILE_SETTINGS = ("compile_scope", "compile_mode", "inductor_options")
"""The train fields that say how blocks are compiled: meaningless, and refused, without compiling."""


class _Parser(OneLineParser):
    def error(self, message):
        extra = message.partition("unrecognized arguments: ")[2].split()
        if extra and all(a.endswith(".bin") for a in extra):  # an unquoted --data glob, expanded
            message += (f" (the shell expanded a glob into {len(extra) + 1} files: quote it, "
                        "e.g. --data 'data/train_*.bin')")
        super().error(message)


def build_parser(description: str = "") -> argparse.ArgumentParser:
    # Defaults are None so that the flags a user typed can be told apart (needed by --resume,
    # which takes every unset value from the checkpoint); the real defaults are shown in help.
    p = _Parser(prog=PROG, description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe, opt, run = (p.add_argument_group(t) for t in ("pipeline", "optimizer", "run"))
    pipe.add_argument("--schedule", choices=SCHEDULES,
                      help=f"sync|gpipe|1f1b: no delay; 2bw: one-step weight delay, no flush; pipedream: "
                           f"one microbatch per step, stage s delayed S-1-s steps (default {_D.pipeline.schedule})")
    pipe.add_argument("--delay", type=int, metavar="K",
                      help="with --schedule 2bw --simulate: a constant K-step weight delay instead of 2bw's one "
                           "(research knob)")
    pipe.add_argument("--delay-only", choices=DELAY_ONLY,
                      help="with --schedule 2bw --simulate: delay only the matrices Muon updates, or only the "
                           "others (embeddings, head, norms, biases); the rest use the newest weights (research "
                           "knob: which part's staleness costs what)")
    pipe.add_argument("--stages", type=int, help=f"pipeline stages (default {_D.pipeline.stages})")
    pipe.add_argument("--microbatches", type=int,
                      help=f"microbatches per step; 2bw needs >= stages (default {_D.pipeline.microbatches}; 1, "
                           "the only count it runs, with --schedule pipedream)")
    pipe.add_argument("--micro-batch-size", type=int,
                      help=f"sequences per microbatch per replica (default {_D.pipeline.micro_batch_size})")
    pipe.add_argument("--dp", type=int,
                      help="data-parallel replicas of the pipeline; stages x dp processes, each step "
                           "takes microbatches x dp x micro-batch-size sequences (default 1)")
    pipe.add_argument("--shard-muon", action=argparse.BooleanOptionalAction, default=None,
                      help="with --dp > 1, each replica runs a share of the Muon orthogonalisations and "
                           "they are gathered; --no-shard-muon: every replica runs all of them itself "
                           "(default on)")
    pipe.add_argument("--transport", choices=TRANSPORTS,
                      help="how stage processes exchange activations and gradients: auto (nccl on "
                           "cuda, socket on cpu), nccl (C++ NCCL, one GPU per rank), torch "
                           "(torch.distributed p2p: NCCL on cuda, one GPU per rank; gloo on cpu), "
                           "gloo (on cuda via host copies: ranks may share a GPU), socket (C++ TCP, "
                           "cpu), ipc (shared memory between stages on one host: CUDA IPC, so ranks "
                           "may share a GPU without host copies) (default auto)")
    pipe.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                      help="recompute each stage's forward before its backward: same losses, less "
                           "activation memory")
    # No argparse choices= for names other engineers' lists grow: the config names the valid ones.
    opt.add_argument("--optimizer", metavar="NAME",
                     help=f"{'|'.join(OPTIMIZERS)} (default {_D.optim.name})")
    opt.add_argument("--lr", type=float, help="learning rate (default per optimizer: " + ", ".join(
        f"{k} {v:g}" for k, v in LR_AUTO.items()) + ")")
    opt.add_argument("--adamw-lr", type=float,
                     help=f"lr of muon's AdamW part (embeddings, head, norms, biases); default {MUON_ADAMW_LR:g}")
    opt.add_argument("--weight-decay", type=float, help=f"default {_D.optim.weight_decay}")
    opt.add_argument("--decay-norms-and-biases", action=argparse.BooleanOptionalAction, default=None,
                     help="weight decay on tensors of fewer than 2 dimensions: norm gains, biases "
                          "(default on; --no-decay-norms-and-biases leaves them undecayed)")
    opt.add_argument("--decay-embeddings", action=argparse.BooleanOptionalAction, default=None,
                     help="weight decay on the embedding tables and a head tied to them (default on; "
                          "--no-decay-embeddings leaves them undecayed)")
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
    run.add_argument("--tokens", type=token_count, metavar="N",
                     help="train for N tokens instead of naming --steps: the steps that reach N at the run's "
                          "tokens per step, rounded up (N a count, or with K, M, B or T: 2.5B)")
    run.add_argument("--seed", type=int, help=f"init and batch-order seed (default {_D.train.seed})")
    run.add_argument("--data-seed", type=int, metavar="N",
                     help="seed of the batch order alone (default: --seed's), so that init and data order "
                          "can vary apart")
    opt.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                     help="lr multiplier over the run: constant, cosine (toward --min-lr-ratio, reached "
                          "as the run ends), wsd (warmup, stable, decay over --decay-steps) or linear (warmup, "
                          "then decay over the rest) (default constant)")
    opt.add_argument("--decay-shape", choices=DECAY_SHAPES,
                     help="wsd's and linear's decay: linear, 1-sqrt (steep, then flat: ends lower in "
                          "cooldown studies) or cosine (default linear)")
    opt.add_argument("--warmup-steps", type=int, help="linear lr warmup steps (default 0)")
    opt.add_argument("--decay-steps", type=int, help="wsd: steps of the final decay (default: a share of --steps)")
    opt.add_argument("--min-lr-ratio", type=float,
                     help="cosine/wsd/linear: the lr they decay to, as a fraction of --lr (default 0.1)")
    opt.add_argument("--clip-grad-norm", type=float, metavar="X",
                     help="clip the gradient to global norm X, measured on the previous step's gradient so "
                          "no stage waits for the others (default: no clipping)")
    opt.add_argument("--z-loss", type=float, metavar="Z",
                     help="add the z-loss Z * mean(logsumexp(logits)^2) to the gradient (PaLM's, 1e-4 there), "
                          "which keeps the logits from drifting; the logged loss stays the cross entropy "
                          "(default 0: off)")
    model = p.add_argument_group("model and data")
    model.add_argument("--data", help="'builtin' (Python's standard library source), a UTF-8 text "
                                      "file, a .bin token file (uint16 nanoGPT format, an llm.c / "
                                      "modded-nanogpt shard, or written by asyncpp-prepare-data), or "
                                      "several: a quoted glob ('data/train_*.bin'), a directory of "
                                      ".bin shards or a shard manifest (default builtin)")
    model.add_argument("--data-mix", action="append", metavar="PATH=WEIGHT", type=data_mix_entry,
                       help="train on a weighted mixture instead of --data: once per source (any --data "
                            "format), e.g. --data-mix 'web/*.bin=0.7' --data-mix code.bin=0.3; weights are "
                            "normalised, each minibatch takes each source's share of its windows (to within "
                            "a window); each source holds out its own end for evaluation (without --val-data)")
    model.add_argument("--val-data", metavar="FILE",
                       help="evaluate on this file, glob, directory or manifest (same formats as "
                            "--data) instead of the end of --data")
    model.add_argument("--skip-batches", type=int, metavar="N",
                       help="with --resume: pass over the data's next N minibatches and continue from the "
                            "checkpoint's step on the ones after them (past a loss spike's batches)")
    model.add_argument("--change-data-mix", action="store_true",
                       help="with --resume (or --auto-resume): a --data-mix other than the checkpoint's takes over "
                            "from its step (e.g. an annealing mixture) instead of being refused; sources in "
                            "both continue their window order")
    model.add_argument("--eval-data", action="append", metavar="PATH",
                       help="another held-out set (same formats as --data) evaluated at every evaluation beside "
                            "eval_loss; once per set: each row's eval_losses holds each set's loss by its file's name "
                            "(a --data-mix run without --val-data also gets each source's held-out part there)")
    model.add_argument("--eval-choices", action="append", metavar="FILE",
                       help="a multiple-choice task (JSON lines of context, endings, label: HellaSwag's val file "
                            "as it is) scored at every evaluation; once per task: each row's choices holds its "
                            "accuracy, accuracy_norm and right_loglik by the file's name")
    model.add_argument("--eval-choices-limit", type=int, metavar="N",
                       help="score the first N examples of each --eval-choices task (default: all)")
    model.add_argument("--sampling", choices=SAMPLINGS,
                       help="order of the training windows: random (uniform starts; default) or epoch "
                            "(consecutive windows, a seeded permutation per epoch: no token trains twice "
                            "before the corpus is used up)")
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
                     help=f"eval every K steps and at the end, 0 = end only (default {_D.train.eval_every}; "
                          "--eval-batches 0: never)")
    run.add_argument("--ckpt-every", type=int,
                     help=f"checkpoint every K steps and at the end, 0 = end only (default {_D.train.ckpt_every}; "
                          "--no-checkpoints: never)")
    run.add_argument("--checkpoints", action=argparse.BooleanOptionalAction, default=None,
                     help="--no-checkpoints: write no checkpoint, not even at the end (a throughput "
                          "run nothing resumes)")
    run.add_argument("--async-checkpoints", action=argparse.BooleanOptionalAction, default=None,
                     help="write each checkpoint in the background while training goes on, the loop "
                          "waiting only for a copy of the state in host memory (default: on for cuda, "
                          "off on cpu, where that copy doubles the state's memory)")
    run.add_argument("--keep-checkpoints", type=int, metavar="N",
                     help="keep only the newest N checkpoints: older ones are removed as each new one "
                          "is complete (default: keep every one)")
    run.add_argument("--eval-batches", type=int, metavar="N",
                     help=f"evaluation batches per eval, 0 = never evaluate (default {_D.data.eval_batches})")
    run.add_argument("--out", help="run directory (default runs/YYYYmmdd-HHMMSS; with --resume, "
                                   "the resumed directory)")
    run.add_argument("--dry-run", action="store_true",
                     help="check everything a start checks (flags, data, evaluation sets, the checkpoint to "
                          "resume, --out) and print the run and the config.json it would write; nothing is "
                          "written, nothing trains")
    run.add_argument("--config", metavar="FILE",
                     help="flags from a TOML or JSON file: keys are these long flags without the dashes "
                          "(steps = 2000, micro-batch-size = 8, simulate = true); the command line's flags "
                          "win over the file's (a repeatable flag adds to the file's values; --steps and "
                          "--tokens may not both be given, across the two)")
    run.add_argument("--resume", metavar="DIR",
                     help="continue DIR's run from its latest checkpoint up to --steps; flags "
                          "left out are taken from the checkpoint")
    run.add_argument("--rewind", type=int, metavar="STEP",
                     help="with --resume: continue from the run's checkpoint at STEP instead of its latest; the "
                          "later checkpoints and metrics rows are moved to RUN/rewound-*/ (e.g. with "
                          "--skip-batches, past a loss spike)")
    run.add_argument("--auto-resume", action="store_true", default=None,
                     help="with --out DIR: continue DIR's run from its latest checkpoint when it has one "
                          "(as --resume DIR with these flags), else start it there: one command for every "
                          "job of a chain (with --time-limit or --stop-on-signal); --init-from then "
                          "serves the first job only")
    run.add_argument("--init-from", metavar="CKPT",
                     help="start a new run from the newest weights of a checkpoint (or of a run "
                          "directory's latest): a new phase with its own data, optimizer and lr schedule, "
                          "which start anew; the model flags default to the checkpoint's")
    run.add_argument("--device", choices=("cpu", "cuda"), help="default cpu")
    run.add_argument("--dtype", choices=DTYPES,
                     help="auto: bf16 autocast on cuda, fp32 on cpu; bf16: autocast with fp32 "
                          "weights and optimizer state (slow on cpu); bf16-params: every parameter copied to "
                          "bf16 per weight version, activations and residual stream bf16, fp32 master weights "
                          "and optimizer state (default auto)")
    run.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=None,
                     help="run the schedule's update rule in one process (delay simulator)")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar on a terminal; --no-progress: none (default on)")
    run.add_argument("--log-grad-norm", action=argparse.BooleanOptionalAction, default=None,
                     help="log each step's global gradient norm (grad_norm in the metrics rows) also without "
                          "--clip-grad-norm, which logs it anyway; costs what clipping's measurement costs")
    run.add_argument("--log-block-grad-norms", action=argparse.BooleanOptionalAction, default=None,
                     help="log each block's gradient norm too (grad_norms in the metrics rows: embed, "
                          "layers.0, ..., head): which layer a spike comes from")
    run.add_argument("--log-every", type=int, metavar="N",
                     help="print a line every N steps (loss, lr, tokens/s, MFU, ETA) and each eval loss on "
                          "stdout, for a batch job's log, where no progress bar shows (default 0: none)")
    run.add_argument("--timeout", type=float, metavar="SECONDS",
                     help=f"abort every rank with a report when no pipeline instruction completes "
                          f"for this long (default {_D.train.timeout_s:g}, or $ASYNCPP_TIMEOUT)")
    run.add_argument("--threads", type=int, metavar="N",
                     help="intra-op threads per process (default: cores / (stages x dp) for each rank "
                          "of a multi-process run, torch's default for one process); runs match "
                          "bitwise only at equal counts")
    run.add_argument("--time-limit", metavar="DURATION",
                     help="stop with a checkpoint before this much time has passed since the command "
                          "started, to be resumed with --resume (a batch job's limit less a margin): "
                          "minutes (230) or units h, m, s (3h50m, 45m, 600s)")
    run.add_argument("--stop-on-signal", metavar="SIGNAL",
                     help="on this signal (USR1, USR2 or TERM; none: off) stop at the end of the current "
                          "segment with a checkpoint, to be resumed with --resume: a batch system's "
                          "warning (SLURM --signal=USR1@120) or a preemption's SIGTERM (default: off)")
    run.add_argument("--signal-response", metavar="DURATION",
                     help="with --stop-on-signal: the longest training segment, so the stop comes "
                          "within about this long after the signal, plus an evaluation and the "
                          f"checkpoint: minutes (2) or units h, m, s (30s, 1m30s) (default "
                          f"{_D.train.signal_response_s:g}s)")
    run.add_argument("--peak-tflops", type=float, metavar="X",
                     help="peak TFLOP/s of one device, for the MFU in the metrics (default: on cuda the "
                          "dense bf16 peak of the GPU's name, H100/H200/A100; none on cpu)")
    run.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                     help="also write TensorBoard events to OUT/tensorboard (pip install "
                          "'asyncpp_ext[tensorboard]')")
    run.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=None,
                     help="also log the metrics rows to Weights & Biases, a W&B run named after OUT "
                          "(pip install 'asyncpp_ext[wandb]'; WANDB_MODE=offline logs to OUT/wandb)")
    run.add_argument("--wandb-project", metavar="NAME",
                     help=f"the W&B project (default {_D.train.wandb_project})")
    run.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="compile each block with torch.compile (--no-compile: eager); default auto: on "
                          "for cuda where torch can compile, off on cpu")
    run.add_argument("--compile-scope", choices=COMPILE_SCOPES,
                     help="what one compiled region covers: block (each block alone: the shortest compile) or "
                          "stage (a stage's blocks but the head as one region: fewer host calls per "
                          "microbatch, a longer compile) (default block)")
    run.add_argument("--compile-mode", choices=COMPILE_MODES,
                     help="inductor's mode for the compiled blocks: default, or max-autotune (kernel "
                          "configurations benchmarked at compile time: minutes more compile; 0.92x "
                          "on an H100 at smollm-360m, docs/gpu.md; inductor's own CUDA graphs off, "
                          "--cuda-graphs still applies) (default default)")
    run.add_argument("--inductor-option", action="append", metavar="NAME=VALUE", type=inductor_option,
                     help="an inductor config option for the compiled blocks, on top of the mode's "
                          "(repeatable, a NAME given twice keeps the last; e.g. max_pointwise_cat_inputs=0: "
                          "each concatenation its own kernel; none: no options, also dropping a resumed "
                          "run's)")
    run.add_argument("--head-loss", choices=HEAD_LOSSES,
                     help="last block's loss: plain (whole logits), fused (chunked matmul + cross entropy, "
                          "no logits in memory), liger / cce (fused with that CUDA kernel), chunked (fused with "
                          "the package's own kernel, whatever is installed), auto (fused for "
                          "vocabularies >= 8192) (default auto)")
    run.add_argument("--attention", choices=ATTENTION_BACKENDS,
                     help="which attention kernel runs first on cuda: cudnn (a shape it cannot serve runs on "
                          "the next), flash (cuDNN's kernels off), flex (with --document-mask: FlexAttention, "
                          "skipping other documents' key blocks; compiled blocks, the package's models), or auto "
                          "(cudnn on Hopper GPUs, torch's own choice elsewhere) (default auto)")
    run.add_argument("--document-mask", nargs="?", const="data", type=document_mask_value, metavar="ID",
                     help="attend within documents: each position reads only the earlier positions of its "
                          "own document, documents starting at a boundary token: the one the data's "
                          "sidecar records (asyncpp-prepare-data), or token id ID (default: off, the whole "
                          "window)")
    run.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="replay each microbatch's forward and backward from CUDA graphs (one launch per "
                          "graph: for small, host-bound models; cuda only, not with --recompute, --document-mask "
                          "or a one-process run of a delayed schedule) (default: on only for --schedule sync on "
                          "cuda without --recompute, --document-mask or --head-loss liger/cce; off otherwise)")
    run.add_argument("--compute-copies", action=argparse.BooleanOptionalAction, default=None,
                     help="under bf16, run linear layers on bf16 copies of their weights made once per weight "
                          "change instead of casting every microbatch (same numbers, fewer kernels) (default on)")
    run.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction, default=None,
                     help="with the compute copies, each linear layer's weight-gradient product adds into the "
                          "float32 gradient itself (cuBLAS on cuda) instead of a bf16 gradient added after "
                          "every microbatch: fewer bytes moved, and no bf16 rounding of each microbatch's "
                          "weight gradient (so not autocast's numbers bit for bit) (default off)")
    run.add_argument("--profile-steps", metavar="FIRST:LAST",
                     help="trace those steps with torch.profiler into OUT/profile/: a Perfetto trace, the "
                          "operator table and the device-busy share per process (off by default)")
    run.add_argument("--on-nonfinite", choices=NONFINITE_POLICIES,
                     help="NaN/Inf loss or gradient: stop the run, or skip that step's update on "
                          f"every stage (default {_D.train.on_nonfinite})")
    run.add_argument("--nonfinite-check", choices=NONFINITE_CHECKS,
                     help="one-process runs: auto queues the optimizer before the host reads the NaN/Inf "
                          "scan, its kernels skipping a bad step on the device where that applies; host "
                          f"reads the scan first (the same numbers) (default {_D.train.nonfinite_check})")
    return p


def config_from_args(args: argparse.Namespace, base: Optional[RunConfig] = None) -> RunConfig:
    """``base`` (defaults, or a resumed run's config) with every flag the user gave applied."""
    cfg = RunConfig.from_dict((base or RunConfig()).to_dict())  # a private copy
    cfg.model = model_from_args(args, cfg.model)
    sets = {
        ("pipeline", "schedule"): args.schedule, ("pipeline", "stages"): args.stages,
        ("pipeline", "delay"): args.delay, ("pipeline", "delay_only"): args.delay_only,
        ("pipeline", "microbatches"): args.microbatches,
        ("pipeline", "micro_batch_size"): args.micro_batch_size, ("pipeline", "dp"): args.dp,
        ("pipeline", "shard_muon"): args.shard_muon,
        ("pipeline", "recompute"): args.recompute, ("pipeline", "transport"): args.transport,
        ("train", "dtype"): args.dtype,
        ("optim", "name"): args.optimizer, ("optim", "lr"): args.lr,
        ("optim", "adamw_lr"): args.adamw_lr, ("optim", "weight_decay"): args.weight_decay,
        ("optim", "decay_norms_and_biases"): args.decay_norms_and_biases,
        ("optim", "decay_embeddings"): args.decay_embeddings,
        ("optim", "ef_beta"): args.ef_beta, ("optim", "ns_dtype"): args.ns_dtype, ("train", "steps"): args.steps,
        ("optim", "ef_source"): args.ef_source, ("optim", "mitigation"): args.mitigation,
        ("optim", "dc_lambda"): args.dc_lambda, ("optim", "rescale_steps"): args.rescale_steps,
        ("optim", "muon_momentum"): args.muon_momentum,
        ("optim", "lr_schedule"): args.lr_schedule, ("optim", "warmup_steps"): args.warmup_steps,
        ("optim", "decay_steps"): args.decay_steps, ("optim", "min_lr_ratio"): args.min_lr_ratio,
        ("optim", "decay_shape"): args.decay_shape,
        ("optim", "clip_grad_norm"): args.clip_grad_norm, ("optim", "z_loss"): args.z_loss,
        ("train", "tensorboard"): args.tensorboard,
        ("train", "wandb"): args.wandb, ("train", "wandb_project"): args.wandb_project,
        ("train", "seed"): args.seed, ("data", "source"): args.data, ("data", "val_source"): args.val_data,
        ("data", "sampling"): args.sampling, ("data", "seed"): args.data_seed, ("data", "mix"): args.data_mix,
        ("data", "eval_data"): args.eval_data, ("data", "eval_choices"): args.eval_choices,
        ("data", "eval_choices_limit"): args.eval_choices_limit,
        ("train", "eval_every"): args.eval_every, ("train", "ckpt_every"): args.ckpt_every,
        ("train", "checkpoints"): args.checkpoints, ("data", "eval_batches"): args.eval_batches,
        ("train", "keep_checkpoints"): args.keep_checkpoints, ("train", "async_checkpoints"): args.async_checkpoints,
        ("train", "out"): args.out, ("train", "device"): args.device, ("train", "auto_resume"): args.auto_resume,
        ("train", "simulate"): args.simulate,
        ("train", "progress"): args.progress, ("train", "log_every"): args.log_every,
        ("train", "log_grad_norm"): args.log_grad_norm, ("train", "log_block_grad_norms"): args.log_block_grad_norms,
        ("train", "timeout_s"): args.timeout if args.timeout is not None else _env_timeout(),
        ("train", "on_nonfinite"): args.on_nonfinite, ("train", "threads"): args.threads,
        ("train", "peak_tflops"): args.peak_tflops, ("train", "time_limit_s"): _duration("--time-limit", args.time_limit),
        ("train", "signal_response_s"): _duration("--signal-response", args.signal_response),
        ("train", "nonfinite_check"): args.nonfinite_check,
        ("train", "compile"): args.compile, ("train", "compile_scope"): args.compile_scope,
        ("train", "compile_mode"): args.compile_mode,
        ("train", "inductor_options"): _inductor_options(args.inductor_option),
        ("train", "head_loss"): args.head_loss,
        ("train", "attention"): args.attention, ("train", "document_mask"): args.document_mask,
        ("train", "profile_steps"): args.profile_steps, ("train", "cuda_graphs"): args.cuda_graphs,
        ("train", "compute_copies"): args.compute_copies,
        ("train", "gradient_accumulation_fusion"): args.gradient_accumulation_fusion,
    }
    for (section, name), value in sets.items():
        if value is not None:
            setattr(getattr(cfg, section), name, value)
    if base is not None and args.compile is False:  # --no-compile turns a resumed run's compiling off whole:
        for name in COMPILE_SETTINGS:  # how it compiled goes too, unless given again now
            if sets[("train", name)] is None:
                setattr(cfg.train, name, getattr(_D.train, name))
    _stop_signal(cfg, args.stop_on_signal)
    if base is None and args.microbatches is None and cfg.pipeline.schedule == "pipedream":
        cfg.pipeline.microbatches = 1  # the only count pipedream runs: one microbatch per step
    if args.tokens is not None:  # after every flag that sets the tokens of a step
        if args.steps is not None:
            raise UsageError(f"--steps {args.steps} and --tokens {args.tokens} both say how long to train; give one")
        cfg.train.steps = steps_for_tokens(args.tokens, cfg)
    cfg.train.resume = args.resume
    cfg.data.change_mix = bool(args.change_data_mix)  # this start only, as --resume
    cfg.data.skip_batches = args.skip_batches or 0  # this start only
    return cfg


def _duration(flag: str, text: Optional[str]) -> Optional[float]:
    """A DURATION flag in seconds (None when not given)."""
    from .time_limit import parse_duration

    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def _stop_signal(cfg: RunConfig, text: Optional[str]) -> None:
    """--stop-on-signal: the signal's full name, or none (a resumed run drops its saved one)."""
    from .stop_request import signal_name

    if text is not None:
        try:
            cfg.train.stop_signal = signal_name(text)
        except ValueError as exc:
            raise ConfigError(f"--stop-on-signal: {exc}") from None


def _env_timeout() -> Optional[float]:
    """ASYNCPP_TIMEOUT when set (it overrides the default and a resumed run's saved value)."""
    from ..pipeline.watchdog import TIMEOUT_ENV, default_timeout_s

    if not os.environ.get(TIMEOUT_ENV, "").strip():
        return None
    try:
        return default_timeout_s()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# Config fields and the flag that sets each, so a config complaint can name what to type.
FIELD_FLAGS = {
    "pipeline.schedule": "--schedule", "pipeline.stages": "--stages",
    "pipeline.microbatches": "--microbatches", "pipeline.micro_batch_size": "--micro-batch-size",
    "pipeline.dp": "--dp", "pipeline.transport": "--transport", "train.dtype": "--dtype",
    "pipeline.delay": "--delay", "pipeline.delay_only": "--delay-only", "model.tie_embeddings": "--model",
    "optim.name": "--optimizer", "optim.lr": "--lr", "optim.adamw_lr": "--adamw-lr",
    "optim.weight_decay": "--weight-decay", "optim.decay_norms_and_biases": "--decay-norms-and-biases",
    "optim.decay_embeddings": "--decay-embeddings", "optim.ef_beta": "--ef-beta", "optim.ns_dtype": "--ns-dtype",
    "train.steps": "--steps", "train.seed": "--seed", "train.eval_every": "--eval-every",
    "train.ckpt_every": "--ckpt-every", "train.checkpoints": "--checkpoints",
    "train.keep_checkpoints": "--keep-checkpoints", "train.async_checkpoints": "--async-checkpoints",
    "data.eval_batches": "--eval-batches", "data.source": "--data", "data.mix": "--data-mix", "data.eval_data": "--eval-data", "data.eval_choices": "--eval-choices", "data.eval_choices_limit": "--eval-choices-limit", "data.change_mix": "--change-data-mix", "data.seed": "--data-seed", "data.skip_batches": "--skip-batches", "data.val_source": "--val-data", "train.device": "--device", "train.timeout_s": "--timeout", "train.out": "--out",
    "train.on_nonfinite": "--on-nonfinite", "train.nonfinite_check": "--nonfinite-check",
    "train.threads": "--threads", "train.peak_tflops": "--peak-tflops", "train.time_limit_s": "--time-limit",
    "train.stop_signal": "--stop-on-signal", "train.signal_response_s": "--signal-response",
    "train.auto_resume": "--auto-resume", "train.wandb_project": "--wandb-project", "train.log_every": "--log-every", "train.log_grad_norm": "--log-grad-norm", "train.log_block_grad_norms": "--log-block-grad-norms", "model.n_layer": "--n-layer",
    "model.n_embd": "--n-embd", "model.n_head": "--n-head", "model.seq_len": "--seq-len",
    "model.vocab_size": "--vocab-size", "optim.clip_grad_norm": "--clip-grad-norm", "optim.z_loss": "--z-loss",
    "optim.warmup_steps": "--warmup-steps", "optim.decay_steps": "--decay-steps",
    "optim.min_lr_ratio": "--min-lr-ratio", "optim.lr_schedule": "--lr-schedule", "optim.decay_shape": "--decay-shape",
    "optim.ef_source": "--ef-source", "optim.mitigation": "--mitigation", "optim.dc_lambda": "--dc-lambda",
    "optim.rescale_steps": "--rescale-steps", "optim.muon_momentum": "--muon-momentum",
    "train.compile_scope": "--compile-scope", "train.compile_mode": "--compile-mode", "train.inductor_options": "--inductor-option", "train.compile": "--compile", "train.head_loss": "--head-loss", "train.attention": "--attention",
    "train.document_mask": "--document-mask",
    "train.profile_steps": "--profile-steps",
    "train.cuda_graphs": "--cuda-graphs", "train.compute_copies": "--compute-copies",
    "train.gradient_accumulation_fusion": "--gradient-accumulation-fusion",
    "data.sampling": "--sampling",
}


def name_flag(message: str) -> str:
    """Prefix a config complaint with the flag that sets the field it starts with."""
    for name in sorted(FIELD_FLAGS, key=len, reverse=True):  # optim.lr_schedule before optim.lr
        if message.startswith(name):
            return f"{FIELD_FLAGS[name]}: {message}"
    return message


__all__ = ["PROG", "UsageError", "build_parser", "config_from_args", "FIELD_FLAGS", "name_flag"]
