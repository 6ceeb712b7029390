"""Checkpoints of the whole asynchronous training state, written atomically.

Layout inside a run directory::

    ckpt-000100/            one directory per checkpoint (step = optimizer steps completed)
        stage-00.pt         one shard per pipeline stage: torch.save of tensors and plain containers
        stage-01.pt         ...
        meta.json           written LAST: step, config, data position, shard sizes + SHA-256

A shard holds ``{"format", "stage", "engine", "rng"}`` where ``engine`` is the step engine's state
keyed by GLOBAL parameter names (``params``, ``stash`` = W(t-1) for 2bw and pipedream, ``older`` =
[W(t-2), ...] per name where pipedream keeps more versions, ``optimizer`` with its
per-parameter state by name), so a checkpoint can be re-split at another pipeline depth.

Atomicity: everything is written into a hidden temporary directory in the run directory (files
fsync'ed, ``meta.json`` last), which is then renamed to ``ckpt-NNNNNN``. A crash before the rename
leaves only the temporary directory, which readers ignore, so the previous checkpoint stays the
latest loadable one. Shards hold CPU tensors only (written from any device) and are loaded with
``torch.load(weights_only=True, map_location="cpu")``; loading a state copies it onto the run's
device (the pipeline's flat buffers, the optimizers' ``load_state_dict``).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Sequence

import torch

from ..pipeline.stage_state import engine_state
from ..schedule.table import schedule_spec
from .config import ConfigError, RunConfig
from .resume_rules import RESUME_MUST_MATCH, get_field, resolved_field

FORMAT_VERSION = 1
META_NAME = "meta.json"
_CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")
_OLD_RE = re.compile(r"^\.old-ckpt-(\d{6,})$")  # a checkpoint being replaced (finalize_checkpoint)
DELETING_PREFIX = ".del-ckpt-"  # a checkpoint being removed (prune_checkpoints); never read


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the file or field and the fix."""


class CheckpointWriteError(OSError):
    """A shard that could not be written (a full disk, most often); the message names the file and
    the space left there. A run failure, not a bad input."""


class NonFiniteCheckpointError(RuntimeError):
    """A checkpoint write refused because a weight holds NaN/Inf (nothing was written)."""


def check_finite_weights(stage: int, engine_state: dict) -> None:
    """NonFiniteCheckpointError when a weight of ``engine_state`` holds NaN/Inf."""
    for section in ("params", "stash", "older"):
        for name, value in engine_state.get(section, {}).items():
            for t in value if isinstance(value, list) else [value]:
                if not (torch.is_tensor(t) and t.is_floating_point()) or bool(torch.isfinite(t).all()):
                    continue
                which = "weight" if section == "params" else "older weight version (stash) of"
                raise NonFiniteCheckpointError(
                    f"refusing to write a checkpoint: the {which} {name!r} of stage {stage} holds "
                    "NaN/Inf; the previous checkpoint is kept (the run diverged: an update from finite "
                    "gradients overflowed the weights, which --on-nonfinite does not catch; lower --lr or "
                    "clip with --clip-grad-norm)")


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:06d}"


def shard_name(stage: int) -> str:
    return f"stage-{stage:02d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def capture_rng_state() -> dict:
    """Global RNG states (torch CPU, CUDA when present, Python ``random``) as loadable tensors/lists."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        # the devices both machines have: a checkpoint from a machine with more GPUs still resumes
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


# -- writing ------------------------------------------------------------------------------------
def temp_checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where a checkpoint is assembled before it is renamed into place."""
    return Path(run_dir) / f".tmp-ckpt-{step:06d}"


def begin_checkpoint(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh hidden temporary directory in ``run_dir`` into which every stage writes its shard."""
    tmp = temp_checkpoint_path(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from an interrupted write
    tmp.mkdir(parents=True)
    return tmp


def to_cpu(obj, copy: bool = False):
    """``obj`` with every tensor in its dicts, lists and tuples moved to the CPU, so a shard written
    on a GPU loads anywhere (and loading never touches a device). ``copy``: CPU tensors copied too,
    a snapshot training can no longer change (a state dict's optimizer tensors are the live ones)."""
    if torch.is_tensor(obj):
        moved = obj.detach().cpu()  # from another device: a copy already
        return moved.clone() if copy and obj.device.type == "cpu" else moved
    if isinstance(obj, dict):
        return {k: to_cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        moved = [to_cpu(v, copy) for v in obj]
        return moved if isinstance(obj, list) else tuple(moved)
    return obj


def _interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (a Ctrl-C, or a stop signal raised as one) that ``exc`` was raised
    while handling, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def write_shard(tmp_dir: Path, stage: int, engine_state: dict, rng_state: dict | None = None) -> tuple[int, str]:
    """Write stage ``stage``'s shard into the temporary directory and fsync it; its (bytes,
    SHA-256). Tensors are saved as CPU tensors whatever device they live on. Refuses
    (NonFiniteCheckpointError) when a weight holds NaN/Inf: a checkpoint never stores NaN."""
    check_finite_weights(stage, engine_state)
    path = Path(tmp_dir) / shard_name(stage)
    payload = {"format": FORMAT_VERSION, "stage": stage, "engine": to_cpu(engine_state),
               "rng": capture_rng_state() if rng_state is None else rng_state}
    try:
        with open(path, "wb") as f:
            torch.save(payload, f)  # a full disk reads "enforce fail at inline_container.cc" here
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:
        stop = _interrupt_behind(exc)
        if stop is not None:  # a Ctrl-C / stop signal landed in torch.save, whose clean-up of the
            raise stop from None  # half-written file then failed: the stop is what happened
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        free = shutil.disk_usage(path.parent).free / 2**20
        raise CheckpointWriteError(f"could not write checkpoint shard {path} ({reason}); {free:.0f} MiB are "
                                   "free there: free disk space or choose another --out") from None
    return path.stat().st_size, _sha256(path)


def finalize_checkpoint(run_dir: str | os.PathLike, tmp_dir: Path, step: int, meta: dict,
                        keep: int | None = None, hashed: dict | None = None) -> Path:
    """Write ``meta.json`` (with the shards' sizes and hashes: ``hashed``'s, by shard name, where
    their writers gave them, else read here) last, then rename into place; then, with ``keep``,
    remove the checkpoints older than the newest ``keep`` (prune_checkpoints)."""
    tmp_dir = Path(tmp_dir)
    shards = sorted(p.name for p in tmp_dir.glob("stage-*.pt"))
    if not shards:
        raise CheckpointError(f"{tmp_dir} holds no stage shard; write_shard must run first")
    hashed = hashed or {}
    record = {**meta, "format": FORMAT_VERSION, "step": step,
              "shards": {n: hashed.get(n) or {"bytes": (tmp_dir / n).stat().st_size, "sha256": _sha256(tmp_dir / n)}
                         for n in shards}}
    with open(tmp_dir / META_NAME, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp_dir)
    final = checkpoint_path(run_dir, step)
    if final.exists():  # re-writing the same step (e.g. a resumed run's final checkpoint)
        old = final.with_name(f".old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp_dir, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp_dir, final)
        stale = final.with_name(f".old-{final.name}")  # from a write interrupted between renames
        if stale.exists():
            shutil.rmtree(stale)
    _fsync_dir(Path(run_dir))
    if keep is not None:
        prune_checkpoints(run_dir, keep)
    return final


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` completed checkpoints of ``run_dir``; their steps. Each is
    first renamed to a hidden ``.del-ckpt-NNNNNN`` (which readers ignore, and a run's next start
    removes if a crash left it), so none is ever found half-deleted."""
    doomed = list_checkpoints(run_dir)[:-keep]
    for step, path in doomed:
        os.replace(path, path.with_name(f"{DELETING_PREFIX}{step:06d}"))
    if doomed:
        _fsync_dir(Path(run_dir))
    for step, path in doomed:
        shutil.rmtree(path.with_name(f"{DELETING_PREFIX}{step:06d}"), ignore_errors=True)
    return [step for step, _ in doomed]


def save_checkpoint(run_dir: str | os.PathLike, step: int, engine_states: list[dict],
                    meta: dict, keep: int | None = None, rng_state: dict | None = None) -> Path:
    """Single-process convenience: all shards (one per stage, in order), then the metadata.
    ``rng_state``: the RNG states to store (default: this process's now)."""
    for stage, state in enumerate(engine_states):
        check_finite_weights(stage, state)  # before anything is created
    tmp = begin_checkpoint(run_dir, step)
    hashed = {shard_name(stage): dict(zip(("bytes", "sha256"), write_shard(tmp, stage, state, rng_state)))
              for stage, state in enumerate(engine_states)}
    return finalize_checkpoint(run_dir, tmp, step, meta, keep, hashed)


# -- reading ------------------------------------------------------------------------------------
def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Completed checkpoint directories of ``run_dir`` as (step, path), oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found, replaced = {}, {}
    for entry in run_dir.iterdir():
        match = _CKPT_RE.match(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
        match = _OLD_RE.match(entry.name)
        if match and entry.is_dir():
            replaced[int(match.group(1))] = entry
    # A crash between the two renames of a re-written checkpoint leaves only the old copy.
    for step, entry in replaced.items():
        found.setdefault(step, entry)
    return sorted(found.items())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        if (Path(run_dir) / "meta.json").is_file() and list_checkpoints(Path(run_dir).resolve().parent):
            raise CheckpointError(f"{run_dir} is a checkpoint; pass its run's directory, --resume "
                                  f"{Path(run_dir).resolve().parent} (its latest checkpoint is taken)")
        raise CheckpointError(f"no checkpoint (ckpt-NNNNNN/) in {run_dir}; pass the --out "
                              "directory of a run that saved one, or start a fresh run")
    return found[-1][1]


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    """The checkpoint's ``meta.json`` (step, config, data position, shard list), format-checked."""
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / META_NAME
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no {META_NAME} (incomplete write); "
                              "delete that directory to fall back on the previous one") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {meta_path} is unreadable or corrupted ({exc}); delete "
                              f"{ckpt_dir} to fall back on the previous checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "shards" not in meta:
        raise CheckpointError(f"checkpoint {meta_path} is not format {FORMAT_VERSION}; it was "
                              "written by another version, resume it with that version")
    missing = [k for k in ("step", "config", "data") if k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint {meta_path} lacks {missing}; the checkpoint is damaged")
    wrong = [(k, what) for k, t, what in (("step", int, "an integer"), ("config", dict, "a mapping"),
                                          ("data", dict, "a mapping"))
             if not isinstance(meta[k], t) or isinstance(meta[k], bool)]
    if wrong:
        raise CheckpointError(f"checkpoint {meta_path} has {wrong[0][0]}={meta[wrong[0][0]]!r}, not "
                              f"{wrong[0][1]}; the checkpoint is damaged")
    if meta["step"] < 0:
        raise CheckpointError(f"checkpoint {meta_path} has step={meta['step']}, below 0; the checkpoint is "
                              f"damaged: delete {ckpt_dir} to fall back on the previous one")
    shards = meta["shards"]
    fit = isinstance(shards, dict) and shards and all(
        isinstance(info, dict) and isinstance(info.get("bytes"), int) and not isinstance(info["bytes"], bool)
        and isinstance(info.get("sha256"), str) for info in shards.values())
    if not fit:
        raise CheckpointError(f"checkpoint {meta_path} has shards={str(shards)[:80]}, not a mapping of each "
                              "shard to its bytes and sha256; the checkpoint is damaged")
    return meta


def load_checkpoint(ckpt_dir: str | os.PathLike, mmap: bool = False) -> tuple[dict, list[dict]]:
    """(meta, shards) of a checkpoint, after checking every shard's size and SHA-256. ``mmap``: the
    shards' tensors map their files, read only where used (a reader of the weights alone leaves
    the optimizer state on disk)."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    shards = []
    for stage, name in enumerate(sorted(meta["shards"])):
        info, path = meta["shards"][name], ckpt_dir / name
        if name != shard_name(stage):
            raise CheckpointError(f"checkpoint {ckpt_dir} lists shard {name}, expected "
                                  f"{shard_name(stage)}; the checkpoint is damaged")
        if not path.is_file():
            raise CheckpointError(f"checkpoint shard {path} is missing; delete {ckpt_dir} to "
                                  "fall back on the previous checkpoint")
        size = path.stat().st_size
        if size != info["bytes"] or _sha256(path) != info["sha256"]:
            what = ("truncated" if size < info["bytes"] else "corrupted",
                    f"{size} bytes, {info['bytes']} expected" if size != info["bytes"] else
                    "its checksum differs from meta.json's")
            raise CheckpointError(f"checkpoint shard {path} is {what[0]} ({what[1]}); delete "
                                  f"{ckpt_dir} to fall back on the previous checkpoint")
        try:
            shards.append(torch.load(path, map_location="cpu", weights_only=True, **({"mmap": True} if mmap else {})))
        except Exception as exc:  # any unpickling failure means the same thing to the user
            raise CheckpointError(f"checkpoint shard {path} cannot be loaded ({type(exc).__name__}:"
                                  f" {str(exc).splitlines()[0] if str(exc) else ''}); delete "
                                  f"{ckpt_dir} to fall back on the previous checkpoint") from None
    return meta, shards


def saved_config(ckpt_dir: str | os.PathLike, meta: dict) -> RunConfig:
    """The run config checkpoint ``ckpt_dir``'s ``meta`` (read_meta) holds; CheckpointError where it
    cannot be read."""
    try:
        return RunConfig.from_dict(meta["config"])
    except (ConfigError, TypeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds an unusable config ({exc})") from None


def check_resume_config(ckpt_dir: str | os.PathLike, saved: dict, run: RunConfig) -> None:
    """Raise CheckpointError naming the first field that would change the resumed run's numbers."""
    try:
        saved_cfg = RunConfig.from_dict(saved)
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds an unusable config ({exc})") from None
    for name in RESUME_MUST_MATCH:
        before, now = get_field(saved_cfg, name), get_field(run, name)
        if before != now and name == "pipeline.global_micro_batch_size":
            was, new = saved_cfg.pipeline, run.pipeline
            fit = (f"; with --dp {new.dp} pass --micro-batch-size {before // new.dp}"
                   if before % new.dp == 0 else "")
            raise CheckpointError(
                f"checkpoint {ckpt_dir} was written with --dp {was.dp} x --micro-batch-size "
                f"{was.micro_batch_size} = {before} sequences per microbatch but this run has --dp "
                f"{new.dp} x --micro-batch-size {new.micro_batch_size} = {now}; keep the product{fit}")
        if resolved_field(saved_cfg, name) != resolved_field(run, name):  # "auto" as the precision it is
            was, new = (f"{v!r}" + (f" ({resolved_field(c, name)} on {c.train.device})" if v == "auto" else "")
                        for v, c in ((before, saved_cfg), (now, run)))
            fix = "resume with the same value (or leave that flag out)"
            if "auto" in (before, now):  # another device: "auto" ran at another precision there
                flag = {"train.dtype": "--dtype", "optim.ns_dtype": "--ns-dtype"}[name]
                fix = f"pass {flag} {resolved_field(saved_cfg, name)} to resume at the checkpoint's precision"
            raise CheckpointError(f"checkpoint {ckpt_dir} was written with {name}={was} but "
                                  f"this run has {new}; {fix}")
    if (saved_cfg.data.val_source is None) != (run.data.val_source is None):
        # --val-data decides what of --data trains: all of it, or all but the held-out end
        was = f"with --val-data {saved_cfg.data.val_source}" if saved_cfg.data.val_source else "without --val-data"
        fix = ("pass --val-data (its path may change)" if saved_cfg.data.val_source else "drop --val-data")
        raise CheckpointError(f"checkpoint {ckpt_dir} was written by a run {was}, which decides the training "
                              "tokens (with it all of --data trains, without it the end of --data is held out "
                              f"for evaluation); {fix}")
    if schedule_spec(saved_cfg.pipeline.schedule).lag_per_stage and saved_cfg.pipeline.stages != run.pipeline.stages:
        raise CheckpointError(f"checkpoint {ckpt_dir} was written by a {saved_cfg.pipeline.schedule} run of --stages "
                              f"{saved_cfg.pipeline.stages}, whose depth sets each stage's delay and the "
                              f"weight versions it keeps; resume with --stages {saved_cfg.pipeline.stages}")
    if saved_cfg.optim.lr_schedule != "constant" and saved_cfg.train.steps != run.train.steps:
        # the decaying schedules place their decay by the run's length: another --steps changes every lr
        raise CheckpointError(f"checkpoint {ckpt_dir} was written by a run of --steps {saved_cfg.train.steps} "
                              f"with --lr-schedule {saved_cfg.optim.lr_schedule}, whose learning rates depend "
                              f"on the run's length; resume with --steps {saved_cfg.train.steps} (or --tokens "
                              f"{saved_cfg.train.steps * saved_cfg.tokens_per_step()}, the same steps)")


def checkpoint_named(path: str, flag: str) -> Path:
    """The checkpoint ``path`` (given as ``flag``) names: itself when it holds a meta.json, else its
    run directory's latest."""
    given = Path(path)
    if not path or not given.is_dir():
        raise CheckpointError(f"{flag} {path or repr(path)} is not a directory; pass a run's --out directory "
                              "or one of its ckpt-NNNNNN directories")
    return given if (given / META_NAME).is_file() else latest_checkpoint(given)


def load_weights(model: torch.nn.Module, ckpt_dir: str | os.PathLike) -> dict:
    """The checkpoint's newest weights W(t) (``params``, merged from every stage's shard) copied into
    ``model``, every name and shape checked first; a tied tensor is stored once under its first
    name, and a pipeline stage's copy of it (a mirror) must equal it. Returns the checkpoint's meta."""
    ckpt_dir = Path(ckpt_dir)
    meta, shards = load_checkpoint(ckpt_dir, mmap=True)
    params = merge_engine_states([shard["engine"] for shard in shards])["params"]
    named = dict(model.named_parameters(remove_duplicate=False))
    owners = dict(model.named_parameters())  # a tied tensor once, under its first name
    missing = [n for n in owners if n not in params]
    unknown = [n for n in params if n not in named]
    if missing or unknown:
        what = f"lacks {missing[:3]}" if missing else f"holds {unknown[:3]}, which the model has not"
        raise CheckpointError(f"checkpoint {ckpt_dir} {what}; the checkpoint is not of this model")
    for name, value in params.items():
        if tuple(value.shape) != tuple(named[name].shape):
            raise CheckpointError(f"checkpoint {ckpt_dir} holds {name} of shape {tuple(value.shape)}, the "
                                  f"model {tuple(named[name].shape)}; the checkpoint is not of this model")
    with torch.no_grad():
        for name, p in owners.items():
            p.copy_(params[name])
    for name, value in params.items():
        if name not in owners and not torch.equal(value, named[name]):
            raise CheckpointError(f"checkpoint {ckpt_dir}: {name}, a tied copy, differs from the tensor it "
                                  "is tied to; the checkpoint is damaged")
    return meta


def merge_engine_states(states: Sequence[dict]) -> dict:
    """One engine state from per-stage shards (any pipeline depth; each a stage's engine state, or
    its checkpoint shard as ``load_checkpoint`` reads it): weights, older versions and optimizer
    state are keyed by global parameter names, so the union is the whole model's state."""
    states = [engine_state(s) for s in states]
    if not states:
        raise CheckpointError("no shards to merge; pass a checkpoint's shards (load_checkpoint(DIR)[1])")
    if len(states) == 1:
        return states[0]
    merged = {"schedule": states[0]["schedule"], "steps_done": states[0]["steps_done"],
              "params": {}, "stash": {}, "older": {}, "optimizer": {"state": {}, "param_groups": []},
              "clip": states[0].get("clip")}  # every stage knows the same previous norm
    for s in states:
        if s["steps_done"] != merged["steps_done"]:
            raise CheckpointError(f"shards disagree on the step ({s['steps_done']} vs "
                                  f"{merged['steps_done']}); merge shards of one checkpoint")
        merged["params"].update(s["params"])
        merged["stash"].update(s["stash"])
        merged["older"].update(s.get("older") or {})
        merged["optimizer"]["state"].update(s["optimizer"]["state"])
        merged["optimizer"]["param_groups"] += s["optimizer"]["param_groups"]
    return merged


__all__ = ["merge_engine_states", "checkpoint_named", "load_weights", "saved_config", "FORMAT_VERSION", "CheckpointError", "NonFiniteCheckpointError", "to_cpu", "checkpoint_path", "temp_checkpoint_path", "shard_name",
           "capture_rng_state", "restore_rng_state", "begin_checkpoint", "write_shard",
           "finalize_checkpoint", "save_checkpoint", "prune_checkpoints", "list_checkpoints", "latest_checkpoint",
           "read_meta", "load_checkpoint", "check_resume_config"]
