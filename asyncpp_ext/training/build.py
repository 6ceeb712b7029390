"""One place that builds a run: a validated ``RunConfig`` (and, in a pipeline, this rank) -> the
data, the model, its optimizer, the step engine behind the ``StepEngine`` protocol (the
``DelaySimulator`` in one process, a ``PipelineEngine`` on each rank), and the resumed state.

The command line (cli.py) parses flags into a config and calls run.train, which builds through
here; so do a pipeline rank (distributed.py), the bench studies, the demo and the GPU kit, so every
way of starting a run builds it the same way. Nothing here parses arguments or prints usage.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..data import (BatchStream, DataError, eval_batches, load_tokens, one_pass_batches, resolve_token_paths,
                    split_tokens)
from ..data.mixture import MixtureStream, mixture_eval_batches
from ..data.sources import describe_tokenizer, tokenizer_of, tokenizers_differ
from ..models.base import row_losses
from ..models.document_mask import within_documents
from ..models.flops import flops_per_token
from ..models.compile import inductor_mode
from ..models.regions import compile_regions, scope_regions
from ..models.registry import build_model
from ..optim import build_optimizer
from ..optim.registry import optimizer_spec
from ..pipeline.partition import as_blocks, split
from .checkpoint import CheckpointError, load_checkpoint, load_weights, merge_engine_states
from .config import RunConfig
from .simulate import DelaySimulator
from .stage_compute import StageCompute, model_loss, stage_compute

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


# ---- data -----------------------------------------------------------------------------------
def build_data(cfg: RunConfig) -> tuple[BatchStream, list]:
    """The run's training stream and evaluation set. Every process of a run builds the same ones:
    with --dp R each microbatch holds the global R*B sequences (a replica takes its rows), and a
    simulation trains on exactly those. So data-parallel replicas read disjoint parts of the data
    by construction (disjoint rows of one seeded draw), whether --data is one file or many shards
    (a glob, directory or manifest, joined in sorted order: data/shards.py), or a mixture."""
    if cfg.data.mix:
        return build_mixture(cfg)
    p = cfg.pipeline
    batch = p.global_micro_batch_size
    tokens = load_tokens(cfg.data.source, cfg.model.vocab_size)
    if cfg.data.val_source is None:
        train_tokens, eval_tokens = split_tokens(tokens, cfg.data.eval_fraction, batch, cfg.model.seq_len,
                                                 source=cfg.data.source)
    else:  # a separate validation file: every token of --data trains
        _refuse_shared_files(cfg.data.source, cfg.data.val_source)
        _refuse_other_tokenizer(cfg.data.source, cfg.data.val_source)
        train_tokens = tokens
        if len(train_tokens) < batch * (cfg.model.seq_len + 1):
            raise DataError(f"--data holds {len(train_tokens)} tokens, fewer than {batch} window(s) of "
                            f"seq_len {cfg.model.seq_len} + 1; use more data or a smaller --seq-len")
    vocab = cfg.model.vocab_size
    stream = BatchStream(train_tokens, p.microbatches, batch, cfg.model.seq_len, seed=cfg.data_seed(),
                         sampling=cfg.data.sampling, vocab_size=vocab, source=f"--data {cfg.data.source}")
    if cfg.data.val_source is not None:
        return stream, _val_data_batches(cfg)
    held_out = f"--data {cfg.data.source}"
    return stream, eval_batches(eval_tokens, batch, cfg.model.seq_len, cfg.data.eval_batches, vocab, held_out)


def _val_data_batches(cfg: RunConfig) -> list:
    """The evaluation set of a run with --val-data."""
    eval_tokens = load_tokens(cfg.data.val_source, cfg.model.vocab_size, flag="--val-data")
    if len(eval_tokens) < cfg.model.seq_len + 1:
        raise DataError(f"--val-data holds {len(eval_tokens)} tokens, fewer than 1 window(s) of "
                        f"seq_len {cfg.model.seq_len} + 1; use more data or a smaller --seq-len")
    return eval_batches(eval_tokens, cfg.pipeline.global_micro_batch_size, cfg.model.seq_len,
                        cfg.data.eval_batches, cfg.model.vocab_size, f"--val-data {cfg.data.val_source}")


def _refuse_shared_files(train: str, val: str, train_flag: str = "--data", val_flag: str = "--val-data") -> None:
    """DataError when a file --val-data names is also one --data names (a directory of shards
    takes every .bin in it, asyncpp-prepare-data's validation shards beside the training ones
    included): what is evaluated must not be trained on."""
    try:
        train_files = {p.resolve() for p in resolve_token_paths(train, train_flag)[0]}
        val_files = [p for p in resolve_token_paths(val, val_flag)[0] if p.resolve() in train_files]
    except DataError:
        return  # named by the loading that follows
    if val_files:
        raise DataError(f"{val_flag} {val} and {train_flag} {train} share {len(val_files)} file(s), e.g. "
                        f"{val_files[0]}: the evaluation would be trained on; point {train_flag} at the "
                        "training shards only (a glob like 'dir/train_*.bin', or their manifest)")


def _refuse_other_tokenizer(train: str, val: str, train_flag: str = "--data", val_flag: str = "--val-data",
                            fix: str = "asyncpp-prepare-data --val-fraction writes both") -> None:
    """DataError when ``val``'s sidecars show another tokenizer than ``train``'s (a text file is
    UTF-8 bytes): a loss over both would score ids of another vocabulary."""
    train_mark, val_mark = tokenizer_of(train, train_flag), tokenizer_of(val, val_flag)
    if tokenizers_differ(train_mark, val_mark):
        raise DataError(f"{val_flag} {val} holds ids of {describe_tokenizer(val_mark)} but {train_flag} {train} "
                        f"those of {describe_tokenizer(train_mark)}: its loss would mean nothing; make both "
                        f"with the same tokenizer ({fix})")


def mixture_sources(cfg: RunConfig) -> tuple[list, list]:
    """(training tokens, held-out tokens) of each ``--data-mix`` source: its last eval_fraction
    held out, or all of it training with --val-data (then the held-out list is empty)."""
    seq_len, vocab = cfg.model.seq_len, cfg.model.vocab_size
    paths = [path for path, _ in cfg.data.mix]
    for path in paths[1:]:
        _refuse_other_tokenizer(paths[0], path, "--data-mix", "--data-mix", "make every source with one tokenizer")
    train_parts, held_out = [], []
    for path in paths:
        tokens = load_tokens(path, vocab, flag="--data-mix")
        if cfg.data.val_source is None:
            train, evaluate = split_tokens(tokens, cfg.data.eval_fraction, 1, seq_len, source=path)
            train_parts.append(train)
            held_out.append(evaluate)
            continue
        _refuse_shared_files(path, cfg.data.val_source, "--data-mix")
        _refuse_other_tokenizer(path, cfg.data.val_source, "--data-mix")
        if len(tokens) < seq_len + 1:
            raise DataError(f"--data-mix {path} holds {len(tokens)} tokens, fewer than one window of seq_len "
                            f"{seq_len} + 1; use more data or a smaller --seq-len")
        train_parts.append(tokens)
    return train_parts, held_out


def mixture_held_out_batches(cfg: RunConfig, held_out: list, batch_size: int, count: int,
                             count_flag: str = "--eval-batches") -> list:
    """``count`` evaluation batches of the sources' held-out windows, mixed by the weights
    (``count_flag``: the flag a count past one pass over them is refused naming)."""
    return mixture_eval_batches(held_out, [weight for _, weight in cfg.data.mix], batch_size, cfg.model.seq_len,
                                count, cfg.model.vocab_size, [f"--data-mix {path}" for path, _ in cfg.data.mix],
                                count_flag)


def build_mixture(cfg: RunConfig, sources: Optional[tuple] = None) -> tuple[MixtureStream, list]:
    """``build_data`` for ``--data-mix`` (data/mixture.py): a stream per source over its training
    part, keyed apart, and the held-out windows of every source by the weights (or --val-data).
    ``sources``: ``mixture_sources(cfg)`` where the caller has read them already."""
    p = cfg.pipeline
    train_parts, held_out = mixture_sources(cfg) if sources is None else sources
    parts = [BatchStream(tokens, p.microbatches, p.global_micro_batch_size, cfg.model.seq_len, seed=cfg.data_seed(),
                         sampling=cfg.data.sampling, vocab_size=cfg.model.vocab_size, source=f"--data-mix {path}")
             for (path, _), tokens in zip(cfg.data.mix, train_parts)]
    stream = MixtureStream(parts, [weight for _, weight in cfg.data.mix], names=[path for path, _ in cfg.data.mix],
                           change=cfg.data.change_mix)
    if cfg.data.val_source is not None:
        return stream, _val_data_batches(cfg)
    return stream, mixture_held_out_batches(cfg, held_out, p.global_micro_batch_size, cfg.data.eval_batches)


def set_names(paths: list) -> list:
    """Short names of data paths for the metrics (``eval_losses`` keys, ``eval/loss/NAME`` tags):
    the last component that is not a glob, without its data suffixes (``data/web/*.bin`` -> web,
    ``val/code.bin`` -> code, ``fw.val.manifest.json`` -> fw.val); the paths themselves where two
    would share a name."""
    names = []
    for path in paths:
        parts = [part for part in Path(path).parts if not any(c in part for c in "*?[")]
        name = parts[-1] if parts else str(path)
        for suffix in (".manifest.json", ".bin", ".txt", ".jsonl", ".json"):
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name[:-len(suffix)]
                break
        names.append(name)
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def has_eval_sets(cfg: RunConfig) -> bool:
    """Whether ``build_eval_sets`` gives any set for ``cfg`` (read from its config alone)."""
    return bool(cfg.data.eval_data) or bool(cfg.data.mix and cfg.data.val_source is None)


def build_run_data(cfg: RunConfig) -> tuple:
    """(``build_data``'s stream and evaluation set, ``build_eval_sets``' named sets) of a run, a
    mixture's sources read once for both."""
    if not cfg.data.mix:
        return (*build_data(cfg), build_eval_sets(cfg))
    sources = mixture_sources(cfg)
    return (*build_mixture(cfg, sources), build_eval_sets(cfg, held_out=sources[1]))


def build_eval_sets(cfg: RunConfig, count: Optional[int] = None, batch_size: Optional[int] = None,
                    held_out: Optional[list] = None) -> dict:
    """The named held-out sets evaluated beside ``eval_loss`` (rows' ``eval_losses``), by
    ``set_names``: each ``--data-mix`` source's held-out part (without --val-data), then each ``--eval-data``;
    ``--eval-batches`` batches each (at most one pass over a set's windows; ``count`` and
    ``batch_size`` replace the run's, as asyncpp-eval's --batches and --batch-size do; ``held_out``:
    the mixture's held-out tokens, ``mixture_sources(cfg)[1]``, where the caller has them). {} when
    the run never evaluates."""
    count = cfg.data.eval_batches if count is None else count
    batch = cfg.pipeline.global_micro_batch_size if batch_size is None else batch_size
    seq_len, vocab = cfg.model.seq_len, cfg.model.vocab_size
    if count == 0:
        return {}
    named = []
    if cfg.data.mix and cfg.data.val_source is None:
        held_out = mixture_sources(cfg)[1] if held_out is None else held_out
        named += [(path, tokens, f"--data-mix {path}") for (path, _), tokens in zip(cfg.data.mix, held_out)]
    trains = [path for path, _ in cfg.data.mix] or [cfg.data.source]
    flag = "--data-mix" if cfg.data.mix else "--data"
    for path in cfg.data.eval_data:
        for source in trains:
            _refuse_shared_files(source, path, flag, "--eval-data")
        _refuse_other_tokenizer(trains[0], path, flag, "--eval-data")
        tokens = load_tokens(path, vocab, flag="--eval-data")
        if len(tokens) < seq_len + 1:
            raise DataError(f"--eval-data {path} holds {len(tokens)} tokens, fewer than one window of seq_len "
                            f"{seq_len} + 1; use more data or a smaller --seq-len")
        named.append((path, tokens, f"--eval-data {path}"))
    sets = {}
    for name, (_, tokens, what) in zip(set_names([path for path, _, _ in named]), named):
        sets[name] = eval_batches(tokens, batch, seq_len, min(count, one_pass_batches(len(tokens) - seq_len, batch)),
                                  vocab, what)
    return sets


def build_choice_sets(cfg: RunConfig) -> dict:
    """--eval-choices: each task file's ``ChoiceSet`` by its short name (``set_names``), encoded
    with the run's tokenizer (found from its data, as asyncpp-eval finds it) after the token that
    starts a document, in batches of the evaluation's shape. UsageError (one line) for a file
    that is not a task, or a run whose tokenizer is unknown."""
    from .choice_eval import choice_set, document_start, read_choices
    from .export import run_tokenizer

    d = cfg.data
    if not d.eval_choices:
        return {}
    tasks = [read_choices(path, d.eval_choices_limit, "--eval-choices") for path in d.eval_choices]
    tokenizer = run_tokenizer("auto", cfg, cfg.model.vocab_size)
    prefix = document_start(tokenizer)

    def encode(text):
        return [int(i) for i in tokenizer.encode([text])[0]]
    return {name: choice_set(examples, encode, cfg.model.seq_len, cfg.pipeline.global_micro_batch_size, prefix)
            for name, examples in zip(set_names(d.eval_choices), tasks)}


# ---- optimizer ------------------------------------------------------------------------------
def optimizer_factory(cfg: RunConfig) -> OptimizerFactory:
    """``(module) -> optimizer`` for cfg.optim (a whole model or one pipeline stage's blocks)."""
    o = cfg.optim
    extra = {}
    if optimizer_spec(o.name).family == "muon":
        extra.update(adamw_lr=o.effective_adamw_lr(), ns_dtype=o.ns_torch_dtype(), momentum=o.muon_momentum)
    return lambda module: build_optimizer(module, o.name, o.effective_lr(), weight_decay=o.weight_decay,
                                          ef_beta=o.effective_ef_beta(), ef_source=o.ef_source,
                                          decay_norms_and_biases=o.decay_norms_and_biases,
                                          decay_embeddings=o.decay_embeddings, **extra)


# ---- engines --------------------------------------------------------------------------------
def simulator_loss(cfg: RunConfig, compute: Optional[StageCompute] = None):
    """The simulator's loss function under the run's --dtype (bf16 autocast or plain fp32) and
    --head-loss; with --cuda-graphs its training calls replay CUDA graphs, one GraphedCompute per
    module it is called with (the model, or its compute copies' module; models/graphs.py;
    evaluation, under no_grad, runs eagerly)."""
    from ..models.graphs import GraphedCompute
    from ..pipeline.recompute import autocast_context, resolve_autocast

    device = torch.device(cfg.train.device)
    autocast_dtype = resolve_autocast(cfg.train.dtype, device)
    compute = compute or stage_compute(cfg)
    inner = model_loss(compute)
    graphs: dict[int, tuple] = {}  # id(module) -> (module, its GraphedCompute)

    def graphed(model_):
        entry = graphs.get(id(model_))
        if entry is None or entry[0] is not model_:
            entry = graphs[id(model_)] = (model_, GraphedCompute(model_, inner))
        return entry[1]

    def loss(model_, inputs, targets):
        with autocast_context(device, autocast_dtype, cache=not compute.cuda_graphs):  # capture refuses the cache
            if compute.cuda_graphs and torch.is_grad_enabled():
                return graphed(model_)(inputs, targets)
            return inner(model_, inputs, targets)
    return loss


def simulator_row_losses(cfg: RunConfig, compute: Optional[StageCompute] = None):
    """The simulator's per-row losses (--eval-choices: models/base.row_losses) under the run's
    --dtype and --document-mask, as a pipeline's last stage computes them."""
    from ..pipeline.recompute import autocast_context, resolve_autocast

    device = torch.device(cfg.train.device)
    autocast_dtype = resolve_autocast(cfg.train.dtype, device)
    boundary = (compute or stage_compute(cfg)).document_boundary

    def rows(model_, inputs, targets):
        with autocast_context(device, autocast_dtype), within_documents(inputs, boundary):
            return row_losses(model_.blocks(), inputs, targets)
    return rows


def build_run_model(cfg: RunConfig, first_weights: bool = True) -> nn.Module:
    """The run's model on the CPU: initialised from the run's seed, then, for a run started
    ``--init-from`` a checkpoint and ``first_weights`` (False where a resumed run's checkpoint
    overwrites them anyway), holding that checkpoint's newest weights."""
    if cfg.train.init_from is None:
        return build_model(cfg.model, seed=cfg.train.seed)
    model = build_model(replace(cfg.model, hf_model=None), seed=cfg.train.seed)
    if first_weights:
        load_weights(model, cfg.train.init_from)
    return model


def build_simulator(cfg: RunConfig, compute: Optional[StageCompute] = None,
                    first_weights: bool = True) -> DelaySimulator:
    """The model (build_run_model) on its device, its optimizer, and the DelaySimulator that
    trains them under the run's schedule in this process (``compute``: stage_compute(cfg), where
    the caller has it)."""
    p = cfg.pipeline
    compute = compute or stage_compute(cfg)
    model = build_run_model(cfg, first_weights).to(cfg.train.device)
    model_flops = flops_per_token(model, cfg.model.seq_len)
    if compute.compile:
        compile_stages(model, cfg.train.device, compute.compile_scope, p.stages, compute.compile_mode,
                       dict(compute.inductor_options))
    from ..pipeline.compute_copies import maybe_compute_copies
    from ..pipeline.recompute import PARAMS_IN_COMPUTE_DTYPE, resolve_autocast

    dtype = resolve_autocast(cfg.train.dtype, torch.device(cfg.train.device))
    every = cfg.train.dtype in PARAMS_IN_COMPUTE_DTYPE  # bf16-params: every parameter, always

    def copies(module: nn.Module):  # made by the simulator once it has untied the model's ties
        # The fused head loss reads its projection weight itself (and keeps a float32 gradient).
        head = [module.blocks()[-1]] if compute.head_loss == "fused" and not every else []
        return maybe_compute_copies(module, dtype, compute.compute_copies or every, exclude=head, every=every,
                                    fuse_weight_gradients=compute.gradient_accumulation_fusion)
    simulator = DelaySimulator(model, optimizer_factory(cfg)(model), p.schedule,
                               loss_fn=simulator_loss(cfg, compute), compute_copies=copies,
                               row_loss_fn=simulator_row_losses(cfg, compute),
                               block_grad_norms=cfg.train.log_block_grad_norms,
                               on_nonfinite=cfg.train.on_nonfinite, device_skip=cfg.train.nonfinite_check == "auto",
                               lr_schedule=cfg.lr_schedule(),
                               clip_grad_norm=cfg.grad_norm_limit(), stages=p.stages, delay=p.delay,
                               delay_only=p.delay_only, **cfg.mitigation_kwargs())
    if compute.cuda_graphs and simulator.delayed:  # it swaps weight versions in, which a graph cannot see
        raise ValueError(f"--cuda-graphs cannot run the simulation of {p.schedule} (its delayed weight "
                         "versions move the parameters a graph reads); run it as a pipeline or drop --cuda-graphs")
    simulator.flops_per_token = model_flops  # the Trainer's TFLOP/s and MFU (utilisation.py)
    return simulator


def compile_stages(model: nn.Module, device, scope: str, stages: int, mode: str = "default",
                   options: Optional[dict] = None):
    """Compile ``model``'s blocks for the simulator by ``--compile-scope``, ``--compile-mode`` and
    ``--inductor-option`` (``options``):
    with scope "stage", one region per stage of the split a Pipeline of ``stages`` stages makes, so
    that the simulator compiles the graphs the pipeline's stages compile and real == --simulate
    stays exact."""
    blocks = as_blocks(model)
    return compile_regions(blocks, scope_regions(scope, split(blocks, stages), len(blocks)), device=device,
                           mode=inductor_mode(mode), options=options or None)


def build_pipeline_engine(cfg: RunConfig, device: str, transport: str, compute: Optional[StageCompute] = None,
                          first_weights: bool = True):
    """This rank's stage of the run's pipeline (torch.distributed already initialised), as a
    ``PipelineEngine``. Every rank builds the whole model (build_run_model) and keeps its blocks
    (``compute``: stage_compute(cfg, device), where the caller has it)."""
    from ..pipeline import Pipeline
    from .pipeline_engine import PipelineEngine

    p = cfg.pipeline
    compute = compute or stage_compute(cfg, device)
    model = build_run_model(cfg, first_weights)
    model_flops = flops_per_token(model, cfg.model.seq_len)  # of the whole model, before the split
    pipe = Pipeline(model, loss_fn=type(model).loss, optimizer=optimizer_factory(cfg), schedule=p.schedule,
                    compile=compute.compile, compile_scope=compute.compile_scope, compile_mode=compute.compile_mode,
                    compile_options=dict(compute.inductor_options),
                    head_loss=compute.head_loss, head_loss_kernel=compute.kernel,
                    microbatches=p.microbatches, stages=p.stages, dp=p.dp, shard_optimizer=p.shard_muon,
                    recompute=p.recompute, dtype=cfg.train.dtype, device=device, transport=transport,
                    cuda_graphs=compute.cuda_graphs, compute_copies=compute.compute_copies,
                    gradient_accumulation_fusion=compute.gradient_accumulation_fusion, z_loss=compute.z_loss,
                    document_mask=compute.document_boundary, block_grad_norms=cfg.train.log_block_grad_norms,
                    timeout_s=cfg.train.timeout_s, on_nonfinite=cfg.train.on_nonfinite,
                    lr_schedule=cfg.lr_schedule(), clip_grad_norm=cfg.grad_norm_limit(),
                    **cfg.mitigation_kwargs())
    engine = PipelineEngine(pipe)
    engine.flops_per_token = model_flops  # the Trainer's TFLOP/s and MFU (utilisation.py)
    return engine


# ---- resume ---------------------------------------------------------------------------------
@dataclass
class Resumed:
    """Where a resumed run continues."""
    start_step: int = 0
    elapsed_s: float = 0.0
    rng: Optional[dict] = None
    """The RNG state to restore once the run directory is ready (None: a fresh run)."""


def resume(engine, stream: BatchStream, resume_dir: Optional[Path], stage: int = 0,
           stages: int = 1, skip_batches: int = 0) -> Resumed:
    """Load ``resume_dir`` (a checkpoint written at any pipeline depth) into the engine and the
    data stream, moved on by ``skip_batches`` minibatches (--skip-batches); the RNG state of this
    stage's shard (shard 0 when the depth changed)."""
    if resume_dir is None:
        return Resumed()
    meta, shards = load_checkpoint(resume_dir)
    try:
        engine.load_state_dict(merge_engine_states([s["engine"] for s in shards]))
        stream.load_state_dict(meta["data"])
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {resume_dir} does not fit this run "
                              f"({str(exc).splitlines()[0]})") from None
    stream.position += skip_batches
    rng = shards[stage if len(shards) == stages else 0]["rng"]
    return Resumed(int(meta["step"]), float(meta.get("elapsed_s", 0.0)), rng)


__all__ = ["build_data", "build_run_data", "build_eval_sets", "optimizer_factory", "simulator_loss", "build_simulator",
           "compile_stages", "build_pipeline_engine", "Resumed", "resume", "OptimizerFactory"]
