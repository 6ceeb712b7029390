"""The checks ``RunConfig.validate`` runs (``check_run``): each field's range, and the rules that
join several fields -- error feedback and the staleness mitigations against the schedule, the
schedule's delays, and how the stages compute. Each raises ConfigError naming the first field that
cannot run and what to do."""
from __future__ import annotations

import math

from ..data.batches import SAMPLINGS
from ..optim.mitigations import DEFAULT_DC_LAMBDA, MITIGATIONS, SIMULATOR_ONLY_MITIGATIONS
from ..optim.versioned import EF_SOURCES
from ..schedule.table import schedule_names, schedule_spec
from ..models.attention import ATTENTION_BACKENDS
from ..models.base import MAX_SEED
from ..models.compile_support import check_inductor_options
from ..models.registry import as_model_config
from ..pipeline.devices import TRANSPORTS
from ..pipeline.watchdog import MAX_TIMEOUT_S
from .config import (COMPILE_MODES, COMPILE_SCOPES, DELAY_ONLY, DEVICES, DTYPES, EF_BETA_MAX, HEAD_LOSSES,
                     LR_SCHEDULE_FLAGS, MAX_THREADS, MIN_TIMEOUT_S, MUON_FAMILY, NONFINITE_CHECKS,
                     NONFINITE_POLICIES, NS_DTYPES, OPTIMIZERS, OptimConfig, RunConfig)
from .field_checks import (ConfigError, choice, non_negative_int, non_negative_number, positive_int,
                           positive_number)
from .profiling import ProfileSpecError, parse_profile_steps
from .stop_request import CHECKPOINT_SIGNALS


def check_mitigation(cfg: RunConfig) -> None:
    """ef_beta, ef_source, mitigation and their combinations with the schedule."""
    o, schedule = cfg.optim, cfg.pipeline.schedule
    if o.ef_beta is not None:
        non_negative_number("optim.ef_beta", o.ef_beta)
        if o.ef_beta > EF_BETA_MAX:
            raise ConfigError(f"optim.ef_beta must be at most {EF_BETA_MAX:g} (0 = off, 0.5 is the default "
                              f"for muon and adamw), got {o.ef_beta!r}")
    choice("optim.ef_source", o.ef_source, EF_SOURCES)
    if o.mitigation is not None:
        choice("optim.mitigation", o.mitigation, MITIGATIONS)
    if o.mitigation not in (None, "ef") and o.ef_beta is not None and o.ef_beta > 0:
        raise ConfigError(f"optim.mitigation={o.mitigation!r} replaces error feedback, but --ef-beta "
                          f"{o.ef_beta:g} turns it on; drop --ef-beta (or pass 0), or use --mitigation ef")
    if o.mitigation == "ef" and o.effective_ef_beta() == 0:
        raise ConfigError(f"optim.mitigation='ef' needs error feedback on, but --ef-beta is 0 for "
                          f"optimizer {o.name!r}; pass --ef-beta > 0 (e.g. 0.5)")
    if o.ef_source == "weights":
        if not schedule_spec(schedule).delayed(cfg.pipeline.stages):  # pipedream's one stage is not
            raise ConfigError(f"optim.ef_source='weights' reads the previous update from the weight versions "
                              f"of a delayed schedule, but --schedule {schedule} at --stages {cfg.pipeline.stages} "
                              "keeps one version; use --schedule 2bw, pipedream over several stages, or "
                              "--ef-source buffer")
        if o.effective_ef_beta() == 0:
            raise ConfigError(f"optim.ef_source='weights' chooses where error feedback reads its previous "
                              f"update, but EF is off (--ef-beta 0, --mitigation {o.effective_mitigation()}); "
                              "pass --ef-beta > 0 or drop --ef-source")
    mitigation = o.effective_mitigation()
    if mitigation in SIMULATOR_ONLY_MITIGATIONS and cfg.runs_multi_process():
        raise ConfigError(f"optim.mitigation={mitigation!r} (weight prediction) needs one more weight version "
                          "than a pipeline stage keeps; add --simulate (or run --stages 1 --dp 1)")
    if mitigation == "lr-rescale" and schedule_spec(schedule).lag_per_stage and not cfg.runs_multi_process():
        raise ConfigError(f"optim.mitigation='lr-rescale' scales each stage's lr by its own delay, but the "
                          f"simulator steps every {schedule} stage with one optimizer; run the pipeline "
                          "without --simulate, or simulate --schedule 2bw (--delay K)")
    if isinstance(o.dc_lambda, bool) or not isinstance(o.dc_lambda, (int, float)) \
            or not 0 <= o.dc_lambda < float("inf"):
        raise ConfigError(f"optim.dc_lambda must be a finite number >= 0, got {o.dc_lambda!r}")
    if o.dc_lambda != DEFAULT_DC_LAMBDA and mitigation != "dc":
        raise ConfigError(f"optim.dc_lambda sets the strength of --mitigation dc, but the mitigation is "
                          f"{mitigation!r}; add --mitigation dc or drop --dc-lambda")
    if o.rescale_steps is not None:
        positive_int("optim.rescale_steps", o.rescale_steps)
        if mitigation != "lr-rescale":
            raise ConfigError(f"optim.rescale_steps sets K of --mitigation lr-rescale, but the mitigation is "
                              f"{mitigation!r}; add --mitigation lr-rescale or drop --rescale-steps")
    if isinstance(o.muon_momentum, bool) or not isinstance(o.muon_momentum, (int, float)) \
            or not 0 <= o.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum must be in [0, 1), got {o.muon_momentum!r}")
    if o.muon_momentum != OptimConfig.muon_momentum and o.name not in MUON_FAMILY:
        raise ConfigError(f"optim.muon_momentum sets the momentum of Muon's matrices, but the optimizer is "
                          f"{o.name!r}; drop --muon-momentum or use --optimizer {' or '.join(MUON_FAMILY)}")

def check_delays(cfg: RunConfig) -> None:
    """The schedule table's shape rule, --delay, and what stages lagging by different amounts
    (pipedream) rule out (docs/design.md §1.16)."""
    p = cfg.pipeline
    spec = schedule_spec(p.schedule)
    try:
        spec.check(p.stages, p.microbatches)
    except ValueError as exc:
        raise ConfigError(f"pipeline.microbatches={p.microbatches}: {exc}") from None
    if p.delay is not None:
        positive_int("pipeline.delay", p.delay)
        if isinstance(cfg.train.steps, int) and p.delay > cfg.train.steps:
            # the simulator keeps delay + 1 copies of the weights: a delay past the run is memory for nothing
            raise ConfigError(f"pipeline.delay={p.delay} is longer than the run (train.steps={cfg.train.steps}): "
                              "every update would come from the initial weights; use a delay <= --steps")
        if spec.lag_per_stage or not spec.delayed() or not cfg.train.simulate:
            raise ConfigError(f"pipeline.delay={p.delay} is a simulator knob generalising 2bw's one-step "
                              f"delay; use it with --schedule 2bw --simulate (got --schedule {p.schedule}"
                              f"{'' if cfg.train.simulate else ' on a real multi-process run'})")
    if p.delay_only is not None:
        choice("pipeline.delay_only", p.delay_only, DELAY_ONLY)
        if spec.lag_per_stage or not spec.delayed() or not cfg.train.simulate:
            raise ConfigError(f"pipeline.delay_only={p.delay_only!r} is a simulator knob; use it with "
                              f"--schedule 2bw --simulate (got {p.schedule}"
                              f"{'' if cfg.train.simulate else ' on a real multi-process run'})")
        if cfg.optim.effective_mitigation() == "lr-rescale":
            raise ConfigError(f"optim.mitigation='lr-rescale' scales the learning rate by the delay, but "
                              f"--delay-only {p.delay_only} delays only some parameters (the optimizer's "
                              "one lr would be rescaled for the undelayed too, or for none); drop one of "
                              "the two")
    if not spec.lag_per_stage:
        return
    if cfg.optim.clip_grad_norm is not None:
        raise ConfigError(f"optim.clip_grad_norm is not supported with {p.schedule} (its stages finish a step "
                          "S-1 steps apart, so a global norm would stall them); use 2bw to clip")
    for name in ("log_grad_norm", "log_block_grad_norms"):
        if getattr(cfg.train, name):
            raise ConfigError(f"train.{name} is not supported with {p.schedule} (its stages finish a step "
                              "S-1 steps apart, so a global norm would stall them); use 2bw to log it")
    if cfg.model.tie_embeddings and p.stages > 1:
        raise ConfigError(f"model.tie_embeddings: {p.schedule} runs each stage on a different weight version, "
                          f"so the embedding (stage 0) and the tied head (stage {p.stages - 1}) cannot share "
                          "one tensor; use 2bw, --stages 1, or an untied model")


def check_document_mask(cfg: RunConfig) -> None:
    """train.document_mask: off, "data" or a token id of the vocabulary; not with CUDA graphs (a
    graph replays the mask it captured)."""
    mask = cfg.train.document_mask
    if mask is None:
        return
    if mask != "data" and (isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < cfg.model.vocab_size):
        raise ConfigError(f"train.document_mask must be 'data' or a token id in [0, {cfg.model.vocab_size}) "
                          f"(the model's vocabulary), got {mask!r}")
    if cfg.train.cuda_graphs:
        raise ConfigError("--cuda-graphs cannot run with --document-mask (a graph replays the mask of the "
                          "microbatch it captured); drop one of them")


def check_compute(cfg: RunConfig) -> None:
    """How the stages compute: --head-loss, --attention, --compile, --compile-scope, --compile-mode,
    --inductor-option, --cuda-graphs, --compute-copies, --gradient-accumulation-fusion,
    --profile-steps."""
    t = cfg.train
    choice("train.head_loss", t.head_loss, HEAD_LOSSES)
    choice("train.attention", t.attention, ATTENTION_BACKENDS)
    if t.compile is not None and not isinstance(t.compile, bool):
        raise ConfigError(f"train.compile must be true, false or null (auto), got {t.compile!r}")
    choice("train.compile_scope", t.compile_scope, COMPILE_SCOPES)
    choice("train.compile_mode", t.compile_mode, COMPILE_MODES)
    try:
        check_inductor_options(t.inductor_options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for name in ("log_grad_norm", "log_block_grad_norms"):
        if not isinstance(getattr(t, name), bool):
            raise ConfigError(f"train.{name} must be true or false, got {getattr(t, name)!r}")
    if not isinstance(t.checkpoints, bool):
        raise ConfigError(f"train.checkpoints must be true or false, got {t.checkpoints!r}")
    if not isinstance(t.compute_copies, bool):
        raise ConfigError(f"train.compute_copies must be true or false, got {t.compute_copies!r}")
    if not isinstance(t.gradient_accumulation_fusion, bool):
        raise ConfigError("train.gradient_accumulation_fusion must be true or false, "
                          f"got {t.gradient_accumulation_fusion!r}")
    if t.gradient_accumulation_fusion and not t.compute_copies and t.dtype != "bf16-params":
        raise ConfigError("train.gradient_accumulation_fusion fuses the compute copies' weight gradients, "
                          "but --no-compute-copies turns them off; drop one of them")
    if t.cuda_graphs is not None and not isinstance(t.cuda_graphs, bool):
        raise ConfigError(f"train.cuda_graphs must be true, false or null (auto), got {t.cuda_graphs!r}")
    if t.cuda_graphs and t.device != "cuda":
        raise ConfigError(f"train.cuda_graphs replays CUDA graphs: it needs --device cuda, got {t.device}")
    check_document_mask(cfg)
    if t.cuda_graphs and cfg.pipeline.recompute:
        raise ConfigError("train.cuda_graphs cannot run with --recompute (a graph replays a forward "
                          "together with its backward); drop one of them")
    if t.profile_steps is not None:
        try:
            first, _ = parse_profile_steps(t.profile_steps)
        except ProfileSpecError as exc:
            raise ConfigError(str(exc)) from None
        if isinstance(t.steps, int) and first > t.steps:
            raise ConfigError(f"train.profile_steps={t.profile_steps} starts after the run's last step "
                              f"(train.steps={t.steps}): nothing would be profiled; profile steps 1..{t.steps}")


__all__ = ["check_compute", "check_delays", "check_mitigation"]


def check_run(cfg: RunConfig) -> None:
    """Raise ConfigError naming the first field of ``cfg`` that cannot run: each field's own range
    here, the rules that join several fields in the functions above."""
    try:
        cfg.model = as_model_config(cfg.model)
        cfg.model.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    positive_int("pipeline.stages", cfg.pipeline.stages)
    positive_int("pipeline.microbatches", cfg.pipeline.microbatches)
    positive_int("pipeline.micro_batch_size", cfg.pipeline.micro_batch_size)
    positive_int("pipeline.dp", cfg.pipeline.dp)
    positive_int("train.steps", cfg.train.steps)
    non_negative_int("train.eval_every", cfg.train.eval_every)
    non_negative_int("train.ckpt_every", cfg.train.ckpt_every)
    if cfg.train.keep_checkpoints is not None:
        positive_int("train.keep_checkpoints", cfg.train.keep_checkpoints)
    non_negative_int("data.eval_batches", cfg.data.eval_batches)
    non_negative_int("train.seed", cfg.train.seed, limit=MAX_SEED)  # torch's and numpy's seeds
    choice("pipeline.schedule", cfg.pipeline.schedule, schedule_names())
    choice("optim.name", cfg.optim.name, OPTIMIZERS)
    _check_optimizer_available(cfg.optim.name)
    choice("train.device", cfg.train.device, DEVICES)
    choice("data.sampling", cfg.data.sampling, SAMPLINGS)
    choice("train.dtype", cfg.train.dtype, DTYPES)
    choice("optim.ns_dtype", cfg.optim.ns_dtype, NS_DTYPES)
    if cfg.optim.ns_dtype != "auto" and cfg.optim.name not in MUON_FAMILY:
        raise ConfigError(f"optim.ns_dtype={cfg.optim.ns_dtype!r} sets muon's Newton-Schulz dtype, but "
                          f"the optimizer is {cfg.optim.name!r}; drop --ns-dtype or use --optimizer muon")
    choice("pipeline.transport", cfg.pipeline.transport, TRANSPORTS)
    if cfg.pipeline.transport == "nccl" and cfg.train.device != "cuda":
        raise ConfigError(f"pipeline.transport='nccl' moves CUDA tensors but train.device="
                          f"{cfg.train.device!r}; use --device cuda, or --transport gloo (or torch) on cpu")
    choice("train.on_nonfinite", cfg.train.on_nonfinite, NONFINITE_POLICIES)
    choice("train.nonfinite_check", cfg.train.nonfinite_check, NONFINITE_CHECKS)
    check_compute(cfg)
    positive_number("train.timeout_s", cfg.train.timeout_s)
    if cfg.train.time_limit_s is not None:
        positive_number("train.time_limit_s", cfg.train.time_limit_s)
        if not cfg.train.checkpoints:
            raise ConfigError("train.time_limit_s stops a run to be resumed from the checkpoint it writes, but "
                              "--no-checkpoints writes none: drop one of them")
    if cfg.train.auto_resume and not cfg.train.checkpoints:
        raise ConfigError("train.auto_resume continues a run from its checkpoints, but --no-checkpoints writes "
                          "none: drop one of them")
    if cfg.train.stop_signal is not None:
        choice("train.stop_signal", cfg.train.stop_signal, CHECKPOINT_SIGNALS)
        if not cfg.train.checkpoints:
            raise ConfigError("train.stop_signal stops a run to be resumed from the checkpoint it writes, but "
                              "--no-checkpoints writes none: drop one of them")
    positive_number("train.signal_response_s", cfg.train.signal_response_s)
    non_negative_int("train.log_every", cfg.train.log_every)
    if not isinstance(cfg.train.wandb_project, str) or not cfg.train.wandb_project.strip():
        raise ConfigError(f"train.wandb_project must name a W&B project, got {cfg.train.wandb_project!r}")
    if cfg.train.peak_tflops is not None:
        positive_number("train.peak_tflops", cfg.train.peak_tflops)
    if cfg.train.threads is not None:
        positive_int("train.threads", cfg.train.threads, limit=MAX_THREADS)
    if cfg.train.timeout_s < MIN_TIMEOUT_S:
        raise ConfigError(f"train.timeout_s must be at least {MIN_TIMEOUT_S:g} s (the process group's "
                          f"collectives use it too), got {cfg.train.timeout_s!r}")
    if cfg.train.timeout_s > MAX_TIMEOUT_S:
        raise ConfigError(f"train.timeout_s must be at most {MAX_TIMEOUT_S:g} s (about 3 years, the longest "
                          f"the process group can wait), got {cfg.train.timeout_s!r}; use {MAX_TIMEOUT_S:g} "
                          "for no practical limit")
    if not isinstance(cfg.train.out, str) or not cfg.train.out.strip():
        raise ConfigError(f"train.out must name the run directory, got {cfg.train.out!r}")
    for name, value in (("data.source", cfg.data.source), ("data.val_source", cfg.data.val_source)):
        if value is not None and (not isinstance(value, str) or not value.strip()):  # '' reads as '.'
            raise ConfigError(f"{name} must name a file, directory, glob or manifest (or builtin), "
                              f"got {value!r}")
    check_data_lists(cfg.data)
    if cfg.optim.lr is not None:
        positive_number("optim.lr", cfg.optim.lr)
    if cfg.optim.adamw_lr is not None:
        positive_number("optim.adamw_lr", cfg.optim.adamw_lr)
        if cfg.optim.name not in MUON_FAMILY:
            raise ConfigError(f"optim.adamw_lr is the learning rate of muon's AdamW part; it "
                              f"does not apply to optim.name={cfg.optim.name!r} (use --lr)")
    non_negative_number("optim.weight_decay", cfg.optim.weight_decay)
    for name in ("decay_norms_and_biases", "decay_embeddings"):
        if not isinstance(getattr(cfg.optim, name), bool):
            raise ConfigError(f"optim.{name} must be true or false, got {getattr(cfg.optim, name)!r}")
    check_mitigation(cfg)
    non_negative_number("optim.momentum", cfg.optim.momentum)
    if cfg.optim.clip_grad_norm is not None:
        positive_number("optim.clip_grad_norm", cfg.optim.clip_grad_norm)
        if cfg.optim.clip_grad_norm == float("inf"):
            raise ConfigError("optim.clip_grad_norm must be finite; leave --clip-grad-norm out to not clip")
    non_negative_number("optim.z_loss", cfg.optim.z_loss)
    non_negative_int("optim.warmup_steps", cfg.optim.warmup_steps)
    try:
        cfg.lr_schedule().validate(LR_SCHEDULE_FLAGS)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.optim.min_lr_ratio is not None and cfg.optim.lr_schedule == "constant":
        raise ConfigError("--min-lr-ratio is where cosine, wsd and linear decay to; the constant schedule never "
                          "decays: drop --min-lr-ratio or pass --lr-schedule cosine, wsd or linear")
    if not 0 < cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction must be in (0, 1), got {cfg.data.eval_fraction}")
    blocks = cfg.model.num_blocks
    if cfg.pipeline.stages > blocks:
        raise ConfigError(f"pipeline.stages={cfg.pipeline.stages} exceeds the model's {blocks} "
                          f"blocks (n_layer {cfg.model.n_layer} + embedding + head); use "
                          f"--stages <= {blocks} or a deeper model (--n-layer)")
    check_delays(cfg)


def _check_optimizer_available(name: str) -> None:
    """A library optimizer whose optional package is missing fails here, before any run starts."""
    from ..optim.library import check_available

    try:
        check_available(name)
    except ValueError as exc:
        raise ConfigError(f"optim.name={name!r}: {exc}") from None


def check_data_lists(data) -> None:
    """data.mix: [path, weight] pairs (a positive finite weight each), given instead of data.source;
    data.eval_data and data.eval_choices: paths, each once."""
    if not isinstance(data.mix, (list, tuple)):
        raise ConfigError(f"data.mix must be a list of [path, weight] pairs, got {data.mix!r}")
    for entry in data.mix:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], str)
                or not entry[0].strip()):
            raise ConfigError(f"data.mix entry {entry!r} is not a [path, weight] pair; write "
                              "--data-mix PATH=WEIGHT")
        weight = entry[1]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            raise ConfigError(f"data.mix: {entry[0]} has weight {weight!r}; give each source a finite weight "
                              "> 0 (weights need not sum to 1)")
    if data.seed is not None:  # None: train.seed's
        non_negative_int("data.seed", data.seed, limit=MAX_SEED)
    non_negative_int("data.skip_batches", data.skip_batches)
    if data.change_mix and not data.mix:
        raise ConfigError("--change-data-mix changes a --data-mix mixture at a resume; this run has none "
                          "(give the new --data-mix)")
    if data.mix and data.source != "builtin":
        raise ConfigError(f"data.source ({data.source}) and data.mix both name the training data; give "
                          "--data or --data-mix, not both")
    if not isinstance(data.eval_data, (list, tuple)) or not all(isinstance(p, str) and p.strip() for p in data.eval_data):
        raise ConfigError(f"data.eval_data must be a list of paths (--eval-data PATH), got {data.eval_data!r}")
    if len(set(data.eval_data)) != len(data.eval_data):
        raise ConfigError("data.eval_data names a set twice; give each --eval-data once")
    if not isinstance(data.eval_choices, (list, tuple)) or not all(isinstance(p, str) and p.strip()
                                                                   for p in data.eval_choices):
        raise ConfigError(f"data.eval_choices must be a list of task files (--eval-choices FILE), got "
                          f"{data.eval_choices!r}")
    if len(set(data.eval_choices)) != len(data.eval_choices):
        raise ConfigError("data.eval_choices names a task twice; give each --eval-choices once")
    if data.eval_choices_limit is not None:
        positive_int("data.eval_choices_limit", data.eval_choices_limit)
    paths = [entry[0] for entry in data.mix]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise ConfigError(f"data.mix names {twice[0]} twice; give each source once, with its whole weight")
