"""The configuration rules that join several fields (``RunConfig.validate`` calls them): error
feedback and the staleness mitigations against the schedule, the schedule's delays, and how the
stages compute. Each raises ConfigError naming the first field that cannot run and what to do."""
from __future__ import annotations

from ..optim.mitigations import DEFAULT_DC_LAMBDA, MITIGATIONS, SIMULATOR_ONLY_MITIGATIONS
from ..optim.versioned import EF_SOURCES
from ..schedule.table import schedule_spec
from ..models.attention import ATTENTION_BACKENDS
from ..models.compile_support import check_inductor_options
from .config import COMPILE_MODES, COMPILE_SCOPES, DELAY_ONLY, EF_BETA_MAX, HEAD_LOSSES, MUON_FAMILY, OptimConfig, RunConfig
from .field_checks import ConfigError, choice, non_negative_number, positive_int
from .profiling import ProfileSpecError, parse_profile_steps


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
    if cfg.model.tie_embeddings and p.stages > 1:
        raise ConfigError(f"model.tie_embeddings: {p.schedule} runs each stage on a different weight version, "
                          f"so the embedding (stage 0) and the tied head (stage {p.stages - 1}) cannot share "
                          "one tensor; use 2bw, --stages 1, or an untied model")


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
