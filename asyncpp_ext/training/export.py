"""``asyncpp-export``: a run's checkpoint as a Hugging Face model directory.

Writes ``config.json`` and ``model.safetensors`` (and, where the run's data names one, the
tokenizer) into a new directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads
and ``asyncpp-train --hf-model`` continues from. The weights are the checkpoint's newest, W(t)
(the ones a resumed run would go on from; a delayed schedule's older versions stay behind), merged
from every stage's shard. Before the directory appears, transformers loads it and its logits are
compared with this package's model on the same weights: a mapping that computed anything else
fails the export, and nothing is left behind.

Every bad input ends with one line ``asyncpp-export: error: ...`` on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from ..command_line import OneLineParser, UsageError, run_command
from ..data import DataError
from ..data.encode import ByteTokenizer, load_tokenizer
from ..data.sources import BYTES_TOKENIZER, tokenizer_of
from ..directories import chmod_as_created
from ..models.hf import require_transformers
from ..models.hf_checks import HFModelError
from ..models.hf_export import DTYPE_NAMES, ExportError, to_transformers
from ..models.registry import build_model, describe
from .checkpoint import CheckpointError, checkpoint_named, list_checkpoints, load_weights, read_meta, saved_config
from .config import ConfigError, RunConfig
from .stage_compute import document_boundary

PROG = "asyncpp-export"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHECK_TOKENS = 64
"""Sequence length of the logits check (or the model's seq_len, if shorter), 2 sequences."""
CHECK_TOLERANCE = 1e-4
"""The check's bound on max |logits difference|, relative to max |logits| (at least 1): float32
sums in another order (transformers' attention and norms against ours) differ by ~1e-6 of that."""
INSTALL_HINT = "pip install 'asyncpp_ext[hf]'"
WEIGHTS_INDEX = "model.safetensors.index.json"
"""Which shard holds each tensor, where the weights are sharded (transformers' name for it)."""


class ExportCheckError(RuntimeError):
    """transformers computed other logits from the written files than the model did."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run directory (its latest checkpoint is exported) or one checkpoint "
                               "directory, ckpt-NNNNNN")
    p.add_argument("--out", required=True,
                   help="the model directory to write (config.json, model.safetensors, the tokenizer's "
                        "files); must not exist, or be empty")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="dtype of the written weights: fp32 (the checkpoint's, exact) or bf16 (half the "
                        "size, each weight rounded to nearest) (default fp32)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest weights file: past it the weights go into shards model-0000K-of-0000N."
                        "safetensors with an index, as transformers writes them (5GB, 500MB, 2GiB; default 5GB)")
    p.add_argument("--tokenizer", default="auto", metavar="auto|none|FILE",
                   help="a tokenizer.json to write beside the weights (with a tokenizer_config.json "
                        "naming its bos/eos tokens); auto: the one the run's --data was prepared with, "
                        "when its sidecar names a file that still exists; none: no tokenizer (default auto)")
    p.add_argument("--average", type=int, default=1, metavar="N",
                   help="export the mean of the weights of the checkpoint and the N-1 before it in its run "
                        "(checkpoint averaging; default 1: the checkpoint alone)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="load the written directory with transformers and compare its logits with the "
                        "checkpoint's model before the directory appears (default on; needs transformers)")
    return p


# --------------------------------------------------------------------------------------------
# Reading the checkpoint


def load_model(ckpt: Path) -> tuple[RunConfig, int, torch.nn.Module]:
    """(run config, step, the model with the checkpoint's newest weights), on the CPU in float32."""
    cfg = saved_config(ckpt, read_meta(ckpt))
    model_cfg = replace(cfg.model, hf_model=None)  # a run from --hf-model: its config, not its files
    model = build_model(model_cfg, seed=cfg.train.seed).eval()
    meta = load_weights(model, ckpt)
    return cfg, meta["step"], model


def averaged_checkpoints(ckpt: Path, count: int, flag: str = "--average") -> list[Path]:
    """``ckpt`` and the ``count - 1`` checkpoints of its run just before it, oldest first;
    UsageError where the run holds fewer."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"{flag} must be at least 1 (1: the checkpoint alone), got {count!r}")
    paths = [path.resolve() for _, path in list_checkpoints(ckpt.parent)]  # oldest first
    upto = paths[:paths.index(ckpt.resolve()) + 1] if ckpt.resolve() in paths else [ckpt]
    if len(upto) < count:
        raise UsageError(f"{flag} {count}: {ckpt.parent} has {len(upto)} checkpoint(s) up to {ckpt.name}; "
                         f"pass {flag} {len(upto)} or less")
    return upto[-count:]


@torch.no_grad()
def load_average(ckpt: Path, count: int) -> tuple[RunConfig, int, torch.nn.Module, str]:
    """``load_model`` of the mean of the newest weights of ``ckpt`` and the ``count - 1``
    checkpoints before it (``averaged_checkpoints``): each parameter summed in float64 and
    rounded once, the way a checkpoint average (LAWA, the stand-in for a final decay) is taken;
    with what it is for messages. The step is ``ckpt``'s."""
    ckpts = averaged_checkpoints(ckpt, count)
    cfg, step, model = load_model(ckpts[-1])
    if count == 1:
        return cfg, step, model, ckpts[-1].name
    sums = {name: p.detach().to(torch.float64, copy=True) for name, p in model.named_parameters()}
    scratch = build_model(replace(cfg.model, hf_model=None), seed=cfg.train.seed)
    for other in ckpts[:-1]:
        load_weights(scratch, other)  # the names and shapes checked: one run's model
        for name, p in scratch.named_parameters():
            sums[name] += p.double()
    for name, p in model.named_parameters():
        p.copy_((sums[name] / count).to(p.dtype))
    return cfg, step, model, f"mean of {ckpts[0].name}..{ckpts[-1].name} ({count})"


# --------------------------------------------------------------------------------------------
# The tokenizer


def data_tokenizer(cfg: RunConfig) -> Optional[dict]:
    """Which tokenizer made the run's training ids, as its ``--data`` sidecars say
    (``data.sources.tokenizer_of``: ``"bytes"`` for text and the built-in corpus), or None."""
    if cfg.data.mix:  # every source has one tokenizer (the run's build refuses others)
        return tokenizer_of(cfg.data.mix[0][0], "--data-mix")
    return tokenizer_of(cfg.data.source) if cfg.data.source else None


def training_data(cfg: RunConfig) -> str:
    """The run's training data as its flags named it: ``--data X`` or ``--data-mix A, B``."""
    if cfg.data.mix:
        return "--data-mix " + ", ".join(path for path, _ in cfg.data.mix)
    return f"--data {cfg.data.source}"


def trained_on_bytes(cfg: RunConfig) -> bool:
    """Whether the run's ids are UTF-8 bytes (its --data is text or the built-in corpus)."""
    mark = data_tokenizer(cfg)
    return mark is not None and mark["tokenizer"] == BYTES_TOKENIZER


def run_document_boundary(cfg: RunConfig, ckpt: Path) -> Optional[int]:
    """The --document-mask token ``ckpt``'s run trained with (None: off): asyncpp-eval and
    asyncpp-sample attend within documents as it trained. UsageError (one line) where the run's
    data no longer says which token that is."""
    try:
        return document_boundary(cfg)
    except ValueError as exc:
        raise UsageError(f"{ckpt}: its run's --document-mask: {exc}") from None


def command_device(choice: str) -> torch.device:
    """``--device auto|cpu|cuda`` of asyncpp-sample and asyncpp-eval: auto = cuda where a GPU is
    visible; UsageError for cuda without one."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible; use --device cpu")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")


def add_compute_flags(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` of asyncpp-sample and asyncpp-eval."""
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model runs: auto = cuda when a GPU is visible (default auto)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="the forward's precision: bf16 autocast (weights stay float32) or float32; auto = "
                        "bf16 on cuda, fp32 on cpu, as training's --dtype auto (default auto)")


def command_autocast(choice: str, device: torch.device):
    """(the autocast context of ``--dtype``'s ``choice`` on ``device``, its name: "bf16" or "fp32")."""
    from ..pipeline.recompute import autocast_context, resolve_autocast

    dtype = resolve_autocast(choice, device)
    return autocast_context(device, dtype), "fp32" if dtype is None else "bf16"


def choose_tokenizer(spec: str, cfg: RunConfig, vocab_size: int):
    """(tokenizer or None, a line saying what was chosen). ``spec``: auto, none or a file."""
    if spec == "none":
        return None, "none (--tokenizer none)"
    mark = data_tokenizer(cfg)
    if spec == "auto":
        if mark is None:
            return None, (f"none (no sidecar of {training_data(cfg)} found from here names one; pass "
                          "--tokenizer FILE)")
        if mark["tokenizer"] == BYTES_TOKENIZER:
            return None, "none (the run trained on UTF-8 bytes: ids are bytes)"
        if not Path(mark["tokenizer"]).is_file():
            return None, f"none ({mark['tokenizer']}, which --data was prepared with, is gone; pass --tokenizer FILE)"
        spec = mark["tokenizer"]
    how = " (the one the run's --data was prepared with)" if spec == (mark or {}).get("tokenizer") else ""
    if mark is not None and mark["tokenizer"] == BYTES_TOKENIZER:
        raise UsageError(f"--tokenizer {spec}: the run trained on UTF-8 bytes ({training_data(cfg)}), "
                         "not on a tokenizer's ids; drop --tokenizer")
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"--tokenizer {spec}: no such file; pass a tokenizer.json, auto or none")
    try:
        tokenizer = load_tokenizer(str(path))
    except DataError as exc:
        raise UsageError(f"--tokenizer: {exc}") from None
    if tokenizer.vocab_size > vocab_size:
        raise UsageError(f"--tokenizer {path} has {tokenizer.vocab_size} ids but the model embeds "
                         f"{vocab_size}; pass the tokenizer the run's data was prepared with")
    if mark is not None and mark["tokenizer"] != BYTES_TOKENIZER and mark.get("tokenizer_sha256") \
            and mark["tokenizer_sha256"] != tokenizer.sha256:
        raise UsageError(f"--tokenizer {path} is not the tokenizer the run's --data was prepared with "
                         f"({mark['tokenizer']}); pass that one, or --tokenizer none")
    return tokenizer, f"{path}{how}"


def run_tokenizer(spec: str, cfg, vocab_size: int):
    """The tokenizer that made the run's ids: ``ByteTokenizer`` for a run on bytes, else the one
    ``choose_tokenizer`` finds (export.py); UsageError where none can be found."""
    if spec == "auto" and trained_on_bytes(cfg):
        if vocab_size < ByteTokenizer.vocab_size:
            raise UsageError(f"the run trained on bytes but its model embeds {vocab_size} ids, not 256")
        return ByteTokenizer()
    tokenizer, line = choose_tokenizer(spec, cfg, vocab_size)
    if tokenizer is None:
        raise UsageError(f"the run's tokenizer is unknown: {line.removeprefix('none (').removesuffix(')')}")
    return tokenizer


def _write_tokenizer(tokenizer, out: Path, config: dict, seq_len: int) -> None:
    """tokenizer.json as it is, a tokenizer_config.json for transformers' generic fast tokenizer,
    and the bos/eos ids in the model's config (the convention asyncpp-prepare-data marks documents by)."""
    shutil.copyfile(tokenizer.name, out / "tokenizer.json")
    _, eos, bos = tokenizer.boundary_tokens()
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    for role, token in (("bos", bos), ("eos", eos)):
        if token is not None:
            settings[f"{role}_token"] = token
            config[f"{role}_token_id"] = tokenizer.token_to_id(token)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# The check


def check_logits(model: torch.nn.Module, directory: Path, vocab_size: int, seq_len: int,
                 dtype: torch.dtype) -> tuple[float, float]:
    """(max |logits difference|, max |logits|) of transformers' model loaded from ``directory``
    against ``model`` with its weights rounded to ``dtype`` (both computing in float32), on 2
    sequences of seeded random ids."""
    transformers = require_transformers()
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # its notes on generation defaults are no part of this
    logging.disable_progress_bar()  # nor its bar over the weights it loads
    try:
        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(directory), **{key: torch.float32}).eval()
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    if dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, min(seq_len, CHECK_TOKENS)), generator=generator)
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits.float()
        ours, _ = model(ids)
    return (theirs - ours.float()).abs().max().item(), ours.abs().max().item()


# --------------------------------------------------------------------------------------------
# The command


def _prepare_out(out: str) -> Path:
    path = Path(out)
    if not out:
        raise UsageError("--out is empty; name the model directory to write")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty directory; choose a new one "
                         "(nothing is overwritten)")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"--out {out}: its parent {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--out {out}: cannot write in {parent}; choose a writable directory")
    return path


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str, flag: str) -> int:
    """Bytes of a size written as transformers writes ``max_shard_size``: "5GB" (10^9), "500MiB"
    (2^20), or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text or "")
    unit = match.group(2).upper() if match else None
    if match is None or unit not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[unit] < 1:
        raise UsageError(f"{flag} {text!r} is not a size; write it as 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def write_weights(tensors: dict, directory: Path, max_bytes: int, save_file) -> list[str]:
    """``tensors`` as ``model.safetensors``, or, past ``max_bytes``, as shards
    ``model-0000K-of-0000N.safetensors`` filled in order (a tensor larger than the bound alone in
    one) with the index transformers reads them by; the weights files' names."""
    shards, current, filled = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and filled + nbytes > max_bytes:
            shards.append(current)
            current, filled = {}, 0
        current[name] = tensor
        filled += nbytes
    shards.append(current)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        chmod_as_created(directory / name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor in shard}}
        (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def export(args) -> list[str]:
    """Write the model directory; the summary lines."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UsageError(f"writing safetensors needs the safetensors package; run {INSTALL_HINT}") from None
    if args.check:
        try:
            require_transformers()  # installed and recent enough, as a Hugging Face model needs
        except HFModelError as exc:
            raise UsageError(f"--check loads the model with transformers: {exc}; or pass --no-check") from None
    out = _prepare_out(args.out)
    max_shard_bytes = parse_size(args.max_shard_size, "--max-shard-size")
    dtype = DTYPES[args.dtype]
    ckpt = checkpoint_named(args.run, "RUN")
    cfg, step, model, what = load_average(ckpt, args.average)  # a bad --average before any weights are read
    tokenizer, tokenizer_line = choose_tokenizer(args.tokenizer, cfg, cfg.model.vocab_size)
    config, tensors = to_transformers(model, cfg.model, dtype)
    tmp = out.resolve().parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if tokenizer is not None:
            _write_tokenizer(tokenizer, tmp, config, cfg.model.seq_len)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        files = write_weights(tensors, tmp, max_shard_bytes, save_file)
        size = sum((tmp / f).stat().st_size for f in files)
        where = files[0] if len(files) == 1 else f"{len(files)} shards indexed by {WEIGHTS_INDEX}"
        averaged = f", the {what}" if args.average > 1 else ""
        lines = [f"{ckpt} (step {step}{averaged}, {describe(cfg.model)}) -> {out}",
                 f"  {config['architectures'][0] if config.get('architectures') else config['model_type']}, "
                 f"{DTYPE_NAMES[dtype]}, {sum(t.numel() for t in tensors.values()):,} parameters, "
                 f"{where}, {size / 2**20:.1f} MiB",
                 f"  tokenizer: {tokenizer_line}"]
        mask = cfg.train.document_mask
        if mask is not None:  # transformers' model has no such mask: say so where the export is made
            token = "the data's boundary token" if mask == "data" else f"token {mask}"
            lines.append(f"  attention: the run trained within documents (--document-mask, {token}); "
                         "transformers' model attends across them: give it one document at a time")
        if args.check:
            del tensors
            diff, scale = check_logits(model, tmp, cfg.model.vocab_size, cfg.model.seq_len, dtype)
            bound = CHECK_TOLERANCE * max(1.0, scale)
            if not diff <= bound:
                raise ExportCheckError(f"transformers' logits from the written files differ from the model's by "
                                       f"{diff:.3e} (bound {bound:.3e}, max |logits| {scale:.3g}); nothing was "
                                       "written")
            lines.append(f"  check: transformers' logits match the model's, max |difference| {diff:.2e} "
                         f"(max |logits| {scale:.3g}; bound {bound:.1e})")
        else:
            lines.append("  check: skipped (--no-check)")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return lines


def _written_nothing(exc: Exception) -> Optional[int]:
    """The export's own failures: a check that failed, a file that could not be written."""
    if isinstance(exc, ExportCheckError):
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 1
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        sys.stderr.write(f"{PROG}: error: {exc.strerror or exc}{where}; nothing was written (free disk space "
                         "or choose another --out)\n")
        return 1
    return None


def main(argv: Optional[list] = None) -> int:
    def work():
        for line in export(build_parser().parse_args(argv)):
            print(line)
    return run_command(PROG, work, (UsageError, CheckpointError, ExportError, ConfigError, HFModelError),
                       stopped_note="; nothing was written", oom_hint="; nothing was written", other=_written_nothing)


__all__ = ["main", "export", "load_model", "load_average", "averaged_checkpoints", "check_logits", "data_tokenizer", "training_data", "trained_on_bytes", "run_document_boundary",
           "run_tokenizer", "command_device"]
