"""A plain Python training script on the asyncpp_ext API: a GPT split into pipeline stages, trained
with 2BW (no flush, one-step weight delay) and Muon with error feedback.

    python examples/train_gpt_pipeline.py                       # spawns 2 local ranks on 127.0.0.1
    torchrun --nproc-per-node 2 examples/train_gpt_pipeline.py  # the same under torchrun
    python examples/train_gpt_pipeline.py --text input.txt --steps 300  # any UTF-8 text file
    python examples/train_gpt_pipeline.py --export gpt-hf       # then: a transformers GPT2LMHeadModel

Every rank runs ``train(args)`` with the same arguments: it builds the whole model (same seed), and
the Pipeline keeps the blocks of its own stage. Stage 0 reads the inputs, the last stage the targets
and the loss; the script prints from the last stage.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

import torch

from asyncpp_ext.data import BatchStream, eval_batches, load_tokens, split_tokens
from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.optim import build_optimizer
from asyncpp_ext.pipeline import LaunchError, Pipeline, init_distributed, spawn, under_launcher


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--text", default="builtin", help="a UTF-8 text file, or 'builtin' (Python's stdlib source)")
    ap.add_argument("--model", default="small", choices=("tiny", "small"), help="model preset")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages = processes")
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches per step (2bw: >= stages)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (AdamW part: 3e-3)")
    ap.add_argument("--ef-beta", type=float, default=0.5, help="error-feedback strength, 0 = off")
    ap.add_argument("--seed", type=int, default=0, help="model init and batch order")
    ap.add_argument("--export", metavar="DIR", help="write the trained model to DIR as a Hugging Face model "
                    "(config.json + model.safetensors; needs safetensors)")
    args = ap.parse_args(argv)
    # Checked here, once, rather than by every rank after it started (seconds, and one line per rank).
    for flag, value, low in (("--stages", args.stages, 1), ("--micro-batch-size", args.micro_batch_size, 1),
                             ("--steps", args.steps, 1), ("--microbatches", args.microbatches, args.stages)):
        if value < low:
            ap.error(f"{flag} must be >= {low}, got {value}" + (" (2bw needs a microbatch per stage)"
                                                                 if flag == "--microbatches" else ""))
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a positive number, got {args.lr}")
    if args.text != "builtin" and not os.path.isfile(args.text):
        ap.error(f"--text {args.text} is not a file; pass a UTF-8 text file or 'builtin'")
    if args.export is not None:
        if os.path.exists(args.export):
            ap.error(f"--export {args.export} exists; name a new directory")
        if importlib.util.find_spec("safetensors") is None:
            ap.error("--export writes safetensors: pip install safetensors")
    return args


def export(weights: dict, config, directory: str) -> None:
    """The gathered weights in a fresh model, written as transformers reads it (GPT2LMHeadModel)."""
    from safetensors.torch import save_file

    from asyncpp_ext.models.hf_export import to_transformers

    model = GPT(config)
    model.load_state_dict(weights)  # every parameter, by its global name
    hf_config, tensors = to_transformers(model, config)
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def train(args: argparse.Namespace) -> None:
    init_distributed()  # joins torchrun's world, or the one spawn() set up
    torch.set_num_threads(1)  # the stages share this machine's cores
    config = preset_config(args.model)
    tokens = load_tokens(args.text, config.vocab_size)
    train_tokens, eval_tokens = split_tokens(tokens, 0.1, args.micro_batch_size, config.seq_len)
    # Every rank draws the same minibatches: a list of `microbatches` (inputs, targets) pairs per step.
    batches = BatchStream(train_tokens, args.microbatches, args.micro_batch_size, config.seq_len, seed=args.seed)
    held_out = eval_batches(eval_tokens, args.micro_batch_size, config.seq_len, count=4)

    model = GPT(config, seed=args.seed)  # the whole model on every rank; each stage keeps its part
    optimizer = lambda stage_module: build_optimizer(stage_module, "muon", lr=args.lr,  # noqa: E731
                                                     adamw_lr=3e-3, ef_beta=args.ef_beta)
    with Pipeline(model, loss_fn=GPT.loss, optimizer=optimizer, schedule="2bw",
                  microbatches=args.microbatches, stages=args.stages) as pipe:
        for stats in pipe.train(batches, steps=args.steps):
            if stats.loss is not None and (stats.step + 1) % 10 == 0:
                print(f"step {stats.step + 1:5d}  loss {stats.loss:.4f}  {stats.elapsed_s:6.1f} s", flush=True)
        eval_loss = pipe.evaluate(held_out)
        if eval_loss is not None:
            print(f"eval loss {eval_loss:.4f} after {args.steps} steps", flush=True)
        if args.export is not None:
            weights = pipe.gather_weights()  # every rank takes part; rank 0 gets the whole model's
            if weights is not None:
                export(weights, config, args.export)
                print(f"exported to {args.export}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if under_launcher():
            train(args)  # torchrun started this process as one rank
        else:
            spawn(train, args.stages, (args,))  # start the ranks here, on 127.0.0.1
    except LaunchError as e:  # each rank printed its own line; this one names the first failure
        print(f"train_gpt_pipeline.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: leaving the `with Pipeline` block stopped the stream
        print("train_gpt_pipeline.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
