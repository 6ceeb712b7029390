"""``asyncpp-sample``: text a run's checkpoint writes after a prompt.

Loads the checkpoint's newest weights (as ``asyncpp-export`` does), encodes the prompt with the
run's tokenizer (UTF-8 bytes for a run on text files or the built-in corpus; else the tokenizer.json
the run's ``--data`` was prepared with, or ``--tokenizer FILE``) and draws new tokens one at a
time (models/generate.py). The text goes to stdout -- as it is drawn for a single sample -- and a
line of figures to stderr. A bad input ends with one line ``asyncpp-sample: error: ...`` and exit
code 2.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional

import torch

from ..command_line import OneLineParser, UsageError, run_command
from ..models.generate import generate
from ..models.hf_checks import HFModelError
from ..models.registry import describe
from .checkpoint import CheckpointError, checkpoint_named
from .config import ConfigError
from .export import (add_compute_flags, command_autocast, command_device, load_model, run_document_boundary,
                     run_tokenizer)

PROG = "asyncpp-sample"
SEPARATOR = "-" * 40
"""The line between samples when several are drawn."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run directory (its latest checkpoint) or one checkpoint directory, ckpt-NNNNNN")
    p.add_argument("--prompt", default="",
                   help="the text to continue (default: none -- a new document: after the tokenizer's "
                        "end-of-text token, else its beginning-of-text token, or a newline where it has "
                        "neither, as bytes have none)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="tokens to draw after the prompt (default 256)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits before sampling: below 1 sharper, above 1 flatter; 0 takes "
                        "the most likely token every time (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, metavar="K",
                   help="sample among the K most likely tokens only; 0 = all (default 200)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the most likely tokens whose probabilities sum to P (nucleus "
                        "sampling; default 1.0 = all)")
    p.add_argument("--samples", type=int, default=1, metavar="N",
                   help=f"independent continuations of the prompt, drawn as one batch and printed one "
                        f"after another between lines of '{SEPARATOR[:3]}...' (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws: the same seed, the same text (default 0)")
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="end a sample at the tokenizer's end-of-text token (default on; a run on bytes has none)")
    p.add_argument("--tokenizer", default="auto", metavar="auto|FILE",
                   help="the tokenizer.json the run's data was prepared with; auto: the one its --data "
                        "sidecar names, or bytes for a run on text (default auto)")
    add_compute_flags(p)
    return p


def check_arguments(args) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = the most likely token), "
                         f"got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = every token), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.samples < 1:
        raise UsageError(f"--samples must be at least 1, got {args.samples}")
    if args.tokenizer == "none":
        raise UsageError("--tokenizer none: sampling encodes the prompt and decodes the ids; pass auto or a "
                         "tokenizer.json")


def first_ids(tokenizer, prompt: str) -> tuple[list[int], int]:
    """(the prompt's ids, how many of them begin a new document and are not printed): without a
    prompt, the tokenizer's end-of-text (or beginning-of-text) token, else a newline's ids."""
    encode = lambda text: [int(i) for i in tokenizer.encode([text])[0]]  # noqa: E731
    ids = encode(prompt) if prompt else []
    if ids:
        return ids, 0
    _, eos, bos = tokenizer.boundary_tokens()
    start = tokenizer.token_to_id(eos or bos) if (eos or bos) else None
    return ([start] if start is not None else encode("\n")), 1


class Printer:
    """Writes one sample's text to ``out`` as its ids arrive: the ids are decoded whole each time
    (a tokenizer's text for an id depends on its neighbours) and the new end written, holding back a
    trailing U+FFFD that may be a character whose bytes are still to come."""

    def __init__(self, decode, out):
        self.decode, self.out, self.ids, self.shown = decode, out, [], ""

    def add(self, new_id: int) -> None:
        self.ids.append(new_id)
        text = self.decode(self.ids)
        ready = text[:-1] if text.endswith("\ufffd") else text
        if ready.startswith(self.shown) and len(ready) > len(self.shown):
            self.out.write(ready[len(self.shown):])
            self.out.flush()
            self.shown = ready

    def finish(self) -> None:
        text = self.decode(self.ids)
        # what is shown is a prefix of the text unless a tokenizer's decoding of an id changed
        # with what followed it: then the text from where the two part is written after it
        common = len(os.path.commonprefix([text, self.shown]))
        self.out.write(text[common:] + "\n")
        self.out.flush()


def sample(args, out=None) -> str:
    """Draw and print the samples (to ``out``, default stdout); the line of figures."""
    check_arguments(args)
    out = sys.stdout if out is None else out
    device = command_device(args.device)
    precision, dtype = command_autocast(args.dtype, device)
    ckpt = checkpoint_named(args.run, "RUN")
    cfg, step, model = load_model(ckpt)
    tokenizer = run_tokenizer(args.tokenizer, cfg, cfg.model.vocab_size)
    boundary = run_document_boundary(cfg, ckpt)  # a --document-mask run samples within documents
    prompt, hidden = first_ids(tokenizer, args.prompt)
    model = model.to(device)
    decode = tokenizer.decode
    eos_name = tokenizer.boundary_tokens()[1]
    eos = tokenizer.token_to_id(eos_name) if (eos_name and args.stop_at_eos) else None
    generator = torch.Generator(device=device).manual_seed(args.seed)
    printers = [Printer(decode, out) for _ in range(args.samples)]
    live = [True] * args.samples
    start, drawn = time.perf_counter(), 0
    if args.samples == 1:
        out.write(decode(prompt[hidden:]))
        out.flush()
    steps = generate(model, torch.tensor([prompt] * args.samples, device=device), args.max_new_tokens,
                     window=cfg.model.seq_len, temperature=args.temperature, top_k=args.top_k or None,
                     top_p=args.top_p, allowed=tokenizer.vocab_size, generator=generator, boundary=boundary)
    with precision:  # each token's forward runs as the loop asks for it
        for new in steps:
            for row, token in enumerate(new.tolist()):
                if not live[row]:
                    continue
                drawn += 1
                if token == eos:
                    live[row] = False
                elif args.samples == 1:
                    printers[row].add(token)
                else:
                    printers[row].ids.append(token)
            if not any(live):
                break
    seconds = time.perf_counter() - start
    if args.samples == 1:
        printers[0].finish()
    else:
        for row, printer in enumerate(printers):
            out.write((SEPARATOR + "\n" if row else "") + decode(prompt[hidden:] + printer.ids) + "\n")
        out.flush()
    how = "greedy" if args.temperature == 0 else (
        f"temperature {args.temperature:g}, top-k {args.top_k or 'all'}, top-p {args.top_p:g}, seed {args.seed}")
    return (f"{PROG}: {ckpt} (step {step}, {describe(cfg.model)}), {args.samples} x up to {args.max_new_tokens} "
            f"tokens, {drawn:,} drawn in {seconds:.1f} s ({drawn / max(seconds, 1e-9):,.0f} tokens/s on {device}, {dtype}), "
            f"{how}")


def main(argv: Optional[list] = None) -> int:
    return run_command(PROG, lambda: sys.stderr.write(sample(build_parser().parse_args(argv)) + "\n"),
                       (UsageError, CheckpointError, ConfigError, HFModelError),
                       oom_hint="; try --device cpu or fewer --samples")


__all__ = ["main", "sample", "first_ids", "Printer"]
