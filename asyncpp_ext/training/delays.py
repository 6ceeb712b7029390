"""How many steps each parameter of the single-process simulator computes behind the newest
weights (its delay d_p, from the schedule table, ``delay`` and ``delay_only``), and the checks on
those arguments, including that the weight versions kept fit in memory."""
from __future__ import annotations

import os

import torch

from ..optim.routing import split_named_parameters
from ..schedule.table import SCHEDULES, schedule_spec


class DelaySimulatorError(ValueError):
    """A simulator argument, input or saved state that cannot run; the message says what to change."""


def only_some_delayed(model, named, delays: list, delay_only: str, per_stage: bool) -> list:
    """``delays`` with every parameter outside the ``delay_only`` set ("matrices": those Muon
    updates; "others": the rest) put back to 0 (the attribution knob, PipelineConfig.delay_only)."""
    if per_stage or delay_only not in ("matrices", "others"):
        raise DelaySimulatorError(f"delay_only={delay_only!r}: use 'matrices' or 'others', with a 2bw-like "
                                  "schedule (one delay for every parameter)")
    muon_ids = {id(p) for _, p in split_named_parameters(model)[0]}
    keep = (lambda p: id(p) in muon_ids) if delay_only == "matrices" else (lambda p: id(p) not in muon_ids)
    return [d if keep(p) else 0 for (_, p), d in zip(named, delays)]


def stage_delay(schedule: str, stage: int, stages: int, delay: int | None = None) -> int:
    """Steps by which ``stage`` (of ``stages``) computes behind the newest weights, from the
    schedule table (0 for the synchronous schedules, 1 for 2bw, ``stages - 1 - stage`` for
    pipedream); ``delay`` replaces a delayed schedule's uniform lag (the --delay K knob)."""
    lag = schedule_spec(schedule).stage_lags(stages)[stage].lag
    return delay if delay is not None and lag else lag


def check_delay_arguments(schedule: str, stages, delay) -> None:
    spec = SCHEDULES[schedule]
    if delay is not None:
        if spec.lag_per_stage or not spec.delayed():
            raise DelaySimulatorError(f"delay={delay!r} sets 2bw's constant K-step delay; it does not "
                                      f"apply to schedule {schedule!r} (use schedule '2bw' or drop delay)")
        if not isinstance(delay, int) or isinstance(delay, bool) or delay < 1:
            raise DelaySimulatorError(f"delay must be an integer >= 1 (1 is plain 2bw), got {delay!r}")
    if spec.lag_per_stage:
        if stages is None:
            raise DelaySimulatorError(f"schedule {schedule!r} needs stages=S: its stages lag by different "
                                      "amounts (pipedream: stage s of S computes S-1-s steps behind); pass "
                                      "the pipeline depth")
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            raise DelaySimulatorError(f"stages must be an integer >= 1, got {stages!r}")


def per_stage_delays(schedule: str, named, blocks, partition: list[list[int]]) -> list[int]:
    """d_p = the lag of p's stage (pipedream: S-1-s) for each parameter of ``named``, s its
    block's stage in ``partition``."""
    stages = len(partition)
    delay_of_block = {b: stage_delay(schedule, s, stages) for s, indices in enumerate(partition)
                      for b in indices}
    delay_of = {}
    for b, block in enumerate(blocks):
        for p in block.parameters():
            delay_of.setdefault(id(p), delay_of_block[b])
    outside = [n for n, p in named if id(p) not in delay_of]
    if outside:
        raise DelaySimulatorError(f"parameter(s) {outside[:3]} belong to no block of the model, so "
                                  "pipedream cannot place them on a stage; keep every parameter in a block")
    return [delay_of[id(p)] for _, p in named]


def check_versions_fit(params, versions_kept: list[int]) -> None:
    """DelaySimulatorError unless the weight versions kept (``versions_kept[i]`` copies of
    ``params[i]``) fit in the memory of the devices holding them: a delay of 10**9 would
    otherwise allocate copy after copy until the process is killed."""
    need: dict[torch.device, int] = {}
    for p, n in zip(params, versions_kept):
        need[p.device] = need.get(p.device, 0) + n * p.numel() * p.element_size()
    for device, nbytes in need.items():
        if device.type == "cuda":
            have, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
        elif device.type == "cpu":
            have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
        else:
            continue
        if nbytes > have:
            raise DelaySimulatorError(f"the delays keep {max(versions_kept)} older version(s) of the weights, "
                                      f"{nbytes / 2**30:.3g} GiB, more than {where} ({have / 2**30:.3g} GiB); "
                                      "use a smaller delay")


__all__ = ["DelaySimulatorError", "check_delay_arguments", "check_versions_fit", "only_some_delayed",
           "per_stage_delays", "stage_delay"]
