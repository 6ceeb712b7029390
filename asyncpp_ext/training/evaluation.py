"""``asyncpp-eval``: the held-out loss of one or more checkpoints, side by side.

Each checkpoint's newest weights (loaded as ``asyncpp-export`` loads them) are evaluated on a fixed
set of windows: by default the run's own evaluation set -- the same windows, as many batches of
the same size, as training evaluated on, so the loss equals the run's ``eval_loss`` at that step
-- or on ``--data FILE`` (a held-out file made with the run's tokenizer), where runs of one
``seq_len`` evaluated with the same ``--batches`` and ``--batch-size`` see the very same windows:
runs of different schedules or optimizers compared on equal terms. The loss is the mean cross
entropy per token in nats (the mean of the batches' means), its perplexity exp(loss), and for a
run on bytes its bits per byte (loss / ln 2).

With ``--choices FILE`` it scores multiple-choice examples instead (HellaSwag and alike:
choice_eval.py). A table goes to stdout, and with ``--json FILE`` its rows as a JSON list. A bad
input ends with one line ``asyncpp-eval: error: ...`` and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Optional

import torch

from ..command_line import OneLineParser, UsageError, check_json_path, run_command
from ..data import DataError, eval_batches, load_tokens, one_pass_batches, split_tokens
from ..data.sources import describe_tokenizer, tokenizer_of, tokenizers_differ
from ..models.hf_checks import HFModelError
from ..models.document_mask import within_documents
from .build import build_eval_sets, has_eval_sets, mixture_held_out_batches, mixture_sources
from .checkpoint import CheckpointError, checkpoint_named, list_checkpoints, read_meta, saved_config
from .config import ConfigError
from .choice_eval import document_start, read_choices, score_choices
from .export import (add_compute_flags, averaged_checkpoints, command_autocast, command_device, data_tokenizer,
                     load_average, run_document_boundary, run_tokenizer, trained_on_bytes)
from .run_files import write_text_atomic

PROG = "asyncpp-eval"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directories (the latest checkpoint of each) or checkpoint directories, ckpt-NNNNNN")
    p.add_argument("--data", metavar="FILE", action="append",
                   help="evaluate on this file, glob, directory or manifest (the formats of asyncpp-train "
                        "--data; made with the runs' tokenizer) instead of each run's own evaluation set; "
                        "repeat it for a row per checkpoint and file (held-out sets of several domains)")
    p.add_argument("--batches", type=int, metavar="N",
                   help="batches of windows to evaluate, spread evenly over the data (default: the run's "
                        "--eval-batches; with --data the first run's for every run, at most one pass over the "
                        "file's windows)")
    p.add_argument("--batch-size", type=int, metavar="B",
                   help="windows per batch (default: the run's micro-batch size times --dp, as it evaluated; "
                        "with --data the first run's for every run)")
    p.add_argument("--average", type=int, default=1, metavar="N",
                   help="evaluate the mean of the weights of each checkpoint and the N-1 before it in its run "
                        "(checkpoint averaging; default 1: the checkpoint alone)")
    p.add_argument("--every-checkpoint", action="store_true",
                   help="evaluate every checkpoint of each run directory, not only its latest (a loss curve)")
    p.add_argument("--choices", metavar="FILE", action="append",
                   help="instead of the loss, the multiple-choice accuracy on a JSON-lines task file of "
                        '{"context", "endings", "label"} examples (HellaSwag\'s jsonl as it is); repeat it for '
                        "a row per checkpoint and file")
    p.add_argument("--limit", type=int, metavar="N", help="--choices: score the first N examples of each file")
    p.add_argument("--tokenizer", default="auto", metavar="auto|FILE",
                   help="--choices: the tokenizer.json the run's data was prepared with; auto: the one its "
                        "data's sidecar names, or bytes for a run on text (default auto)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list to FILE")
    add_compute_flags(p)
    return p


def check_arguments(args) -> None:
    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.average > 1 and args.every_checkpoint:
        raise UsageError("--average N with --every-checkpoint: pass one of them (evaluate the runs' latest "
                         "averages, or every checkpoint alone)")
    if args.choices:
        given = [flag for flag, value in (("--data", args.data), ("--batches", args.batches),
                                          ("--batch-size", args.batch_size)) if value is not None]
        if given:
            raise UsageError(f"{given[0]} sets the windows of the loss; --choices scores its examples instead: "
                             "drop one of them")
        if args.limit is not None and args.limit < 1:
            raise UsageError(f"--limit must be at least 1, got {args.limit}")
    elif args.limit is not None or args.tokenizer != "auto":
        raise UsageError(f"{'--limit' if args.limit is not None else '--tokenizer'} applies to --choices only")
    check_json_path(args.json)


def checkpoints_of(run: str, every: bool) -> list[Path]:
    """The checkpoints named by ``run``: its latest (or the one given), or all of a run directory's."""
    path = Path(run)
    if every and path.is_dir() and not path.name.startswith("ckpt-"):
        found = [p for _, p in list_checkpoints(path)]
        if found:
            return found
    return [checkpoint_named(run, "RUN")]


def evaluation_set(cfg, data: Optional[str], batches: Optional[int], batch_size: Optional[int],
                   data_windows: Optional[tuple] = None) -> tuple[list, str]:
    """(the (inputs, targets) batches to evaluate ``cfg``'s model on, what they are). For a
    ``data`` file, ``data_windows`` (count, size, whether the count was given) replaces the run's
    own: ``evaluate`` scores every run on the same windows of a file."""
    use_shared = data is not None and data_windows is not None
    count, size, given = data_windows if use_shared else window_sizes(cfg, batches, batch_size, "the run")
    flag = "--batches"  # a count the data cannot hold came from it (the run's own held at training)
    vocab, seq_len = cfg.model.vocab_size, cfg.model.seq_len
    if data is None and cfg.data.val_source is not None:
        tokens = load_tokens(cfg.data.val_source, vocab, flag="--val-data")
        return eval_batches(tokens, size, seq_len, count, vocab, f"--val-data {cfg.data.val_source}", flag), \
            cfg.data.val_source
    if data is None and cfg.data.mix:  # each source's held-out end, mixed as training mixed them
        return mixture_held_out_batches(cfg, mixture_sources(cfg)[1], size, count, flag), \
            f"the held-out {cfg.data.eval_fraction:g} of each --data-mix source"
    if data is None:  # the split training made (where it falls does not depend on the batch size)
        tokens = split_tokens(load_tokens(cfg.data.source, vocab), cfg.data.eval_fraction, 1, seq_len,
                              source=cfg.data.source)[1]
        return eval_batches(tokens, size, seq_len, count, vocab, f"--data {cfg.data.source}", flag), \
            f"the held-out {cfg.data.eval_fraction:g} of {cfg.data.source}"
    theirs, ours = tokenizer_of(data), data_tokenizer(cfg)
    if tokenizers_differ(ours, theirs):
        raise DataError(f"--data {data} holds ids of {describe_tokenizer(theirs)} but the run trained on those of "
                        f"{describe_tokenizer(ours)}: its loss would mean nothing; evaluate on data made with the "
                        "run's tokenizer")
    tokens = load_tokens(data, vocab)
    if not given:  # a count of a run's: at most one pass over the file's windows, as --eval-data sets get
        count = min(count, one_pass_batches(len(tokens) - seq_len, size))
    return eval_batches(tokens, size, seq_len, count, vocab, f"--data {data}", flag), data


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: list, device: torch.device, boundary: Optional[int] = None) -> float:
    """The mean over ``batches`` of each batch's mean cross entropy (nats per token); with a
    ``boundary`` token id, attending within documents as the run trained (--document-mask)."""
    total = 0.0
    for x, y in batches:
        x = x.to(device)
        with within_documents(x, boundary):
            _, loss = model(x, y.to(device))
        total += loss.item()
    return total / len(batches)


def _sets_of(cfg, data, args, data_windows: Optional[tuple]) -> list[tuple]:
    """(batches, what they are, whether the run is on bytes) of each set a run is scored on for
    ``data``: the file, or (None) the run's own evaluation set and then each of its named sets
    (build.build_eval_sets: the ones its rows' eval_losses hold, under the same names)."""
    on_bytes = trained_on_bytes(cfg)
    found = [(*evaluation_set(cfg, data, args.batches, args.batch_size, data_windows), on_bytes)]
    if data is None:
        named = build_eval_sets(cfg, count=args.batches, batch_size=args.batch_size)
        found += [(batches, name, on_bytes) for name, batches in named.items()]
    return found


def _row(run, ckpt, step, model, batches, what, on_bytes, device, precision, dtype, args, several,
         boundary=None) -> dict:
    """One checkpoint's loss on one set, printed as the table's line."""
    start = time.perf_counter()
    with precision:
        loss = mean_loss(model, batches, device, boundary)
    row = {"run": str(run), "checkpoint": str(ckpt), "step": step, "loss": loss,
           "perplexity": math.inf if loss >= 709 else math.exp(loss),  # math.exp raises past ~709.78
           "bits_per_byte": loss / math.log(2) if on_bytes else None,
           "tokens": sum(int(y.numel()) for _, y in batches), "data": what, "device": device.type,
           "dtype": dtype, "averaged": args.average,
           "seconds": time.perf_counter() - start}
    bpb = f"{row['bits_per_byte']:.4f}" if on_bytes else "-"
    print(f"{str(ckpt)[-44:]:<44} {step:>7} {loss:>8.4f} {row['perplexity']:>9.3f} {bpb:>9} "
          f"{row['tokens']:>10,} {row['seconds']:>6.1f}" + (f"  {what}" if several else ""), flush=True)
    return row


def evaluate(args) -> list[dict]:
    """One row per checkpoint (and ``--data`` file); prints the table as rows are done."""
    check_arguments(args)
    device = command_device(args.device)
    precision, dtype = command_autocast(args.dtype, device)
    ckpts = [(run, ckpt) for run in args.runs for ckpt in checkpoints_of(run, args.every_checkpoint)]
    for _, ckpt in ckpts:  # every --average window there before any weights are read
        averaged_checkpoints(ckpt, args.average)
    if args.choices:
        return _write_json(args, evaluate_choices(args, ckpts, device, precision, dtype))
    datas = args.data or [None]  # None: each run's own evaluation set, and its eval_losses sets
    # then each row names its data
    several = len(datas) > 1 or (args.data is None and any(has_eval_sets(saved_config(c, read_meta(c)))
                                                           for _, c in ckpts))
    data_windows = _data_windows(args, ckpts[0][1]) if args.data else None
    sets, boundaries = {}, {}  # every set built (and checked) before the table starts; a run's checkpoints share
    for _, ckpt in ckpts:
        cfg = saved_config(ckpt, read_meta(ckpt))
        boundaries[ckpt] = run_document_boundary(cfg, ckpt)
        for data in datas:
            if _set_key(data, cfg) not in sets:
                sets[_set_key(data, cfg)] = _sets_of(cfg, data, args, data_windows)
    rows = []
    print(f"{'checkpoint':<44} {'step':>7} {'loss':>8} {'ppl':>9} {'bits/byte':>9} {'tokens':>10} {'s':>6}"
          + ("  data" if several else ""))
    for run, ckpt in ckpts:
        cfg, step, model, _ = load_average(ckpt, args.average)
        model = model.to(device)
        for data in datas:
            for batches, what, on_bytes in sets[_set_key(data, cfg)]:
                rows.append(_row(run, ckpt, step, model, batches, what, on_bytes, device, precision, dtype, args,
                                 several, boundaries[ckpt]))
    shown = sorted({r["data"] for r in rows})
    print((f"data: {shown[0]}" if len(shown) == 1 else "data: each row's column" if several else
           "data: each run's own evaluation set (pass --data to compare runs on the same windows)")
          + f"; on {device.type} in {dtype}" + _averaged(args))
    return _write_json(args, rows)


def _set_key(data: Optional[str], cfg) -> tuple:
    """What a run's sets of ``data`` depend on: runs and checkpoints alike here share them."""
    return data, repr(cfg.data), cfg.model.seq_len, cfg.model.vocab_size, cfg.pipeline.global_micro_batch_size


def window_sizes(cfg, batches: Optional[int], batch_size: Optional[int], who: str) -> tuple:
    """(batches, windows per batch, whether --batches was given): --batches and --batch-size, else
    ``cfg``'s run's evaluation size; UsageError for a run that never evaluated (``who``: it)."""
    count = cfg.data.eval_batches if batches is None else batches
    size = cfg.pipeline.global_micro_batch_size if batch_size is None else batch_size
    if count == 0:
        raise UsageError(f"{who} never evaluated (--eval-batches 0): pass --batches N")
    return count, size, batches is not None


def _data_windows(args, first_ckpt: Path) -> tuple:
    """``window_sizes`` for every run's rows on a --data file: the first checkpoint's run's, so that
    runs of one seq_len are scored on the same windows whatever their own sizes."""
    return window_sizes(saved_config(first_ckpt, read_meta(first_ckpt)), args.batches, args.batch_size,
                        f"{first_ckpt}'s run")


def _averaged(args) -> str:
    return (f"; each row the mean of the weights of its checkpoint and the {args.average - 1} before it"
            if args.average > 1 else "")


def _write_json(args, rows: list[dict]) -> list[dict]:
    if args.json is not None:  # JSON has no NaN or Infinity: a non-finite figure is written null
        finite = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                  for r in rows]
        write_text_atomic(Path(args.json), json.dumps(finite, indent=1) + "\n")
    return rows


def evaluate_choices(args, ckpts: list, device, precision, dtype: str) -> list[dict]:
    """One row per checkpoint and --choices file: its accuracy and accuracy_norm (choice_eval.py)."""
    tasks = {path: read_choices(path, args.limit) for path in args.choices}  # every file checked first
    rows = []
    print(f"{'checkpoint':<44} {'step':>7} {'accuracy':>9} {'acc_norm':>9} {'examples':>9} {'s':>6}  task")
    for run, ckpt in ckpts:
        cfg, step, model, _ = load_average(ckpt, args.average)
        model, boundary = model.to(device), run_document_boundary(cfg, ckpt)
        tokenizer = run_tokenizer(args.tokenizer, cfg, cfg.model.vocab_size)
        encode = lambda text: [int(i) for i in tokenizer.encode([text])[0]]  # noqa: E731
        prefix = document_start(tokenizer)
        for path, examples in tasks.items():
            row = {"run": str(run), "checkpoint": str(ckpt), "step": step, "task": path,
                   **score_choices(model, encode, examples, cfg.model.seq_len, device, precision, prefix, boundary),
                   "device": device.type, "dtype": dtype, "averaged": args.average}
            rows.append(row)
            print(f"{str(ckpt)[-44:]:<44} {step:>7} {row['accuracy']:>9.4f} {row['accuracy_norm']:>9.4f} "
                  f"{row['examples']:>9,} {row['seconds']:>6.1f}  {path}", flush=True)
    print(f"on {device.type} in {dtype}; accuracy: the label's ending the most likely, acc_norm: per byte"
          + _averaged(args))
    return rows


def main(argv: Optional[list] = None) -> int:
    return run_command(PROG, lambda: evaluate(build_parser().parse_args(argv)),
                       (UsageError, CheckpointError, ConfigError, DataError, HFModelError),
                       oom_hint="; try --device cpu or a smaller --batch-size")


__all__ = ["main", "evaluate", "evaluate_choices", "evaluation_set", "mean_loss"]
