"""Workers for the tied-weight tests (importable by spawned ranks): the tied llama-tiny under the
CLI's Muon hybrid, trained through a real pipeline."""
import os

import torch

from asyncpp_ext.models import Llama, llama_preset_config
from asyncpp_ext.pipeline import Pipeline, init_distributed
from pipeline_workers import cli_muon_factory as muon_factory  # asyncpp-train --optimizer muon

CONFIG = llama_preset_config("llama-tiny", seq_len=8)
CLIP = 0.5  # small enough that clipping acts on most steps (the tiny model's norms are ~1-3)


def model() -> Llama:
    return Llama(CONFIG, seed=0)


def minibatches(steps: int, m: int, micro_batch: int = 2, seed: int = 7) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = [torch.randint(0, CONFIG.vocab_size, (micro_batch, CONFIG.seq_len + 1), generator=g) for _ in range(m)]
        out.append([(r[:, :-1], r[:, 1:]) for r in rows])
    return out


def tied_worker(schedule: str, m: int, steps: int, out_dir: str) -> None:
    init_distributed(60)
    torch.set_num_threads(1)  # as the simulator in the test process: the same arithmetic, bitwise
    pipe = Pipeline(model(), loss_fn=Llama.loss, optimizer=muon_factory, schedule=schedule, microbatches=m,
                    clip_grad_norm=CLIP)
    data = minibatches(steps, m)
    half = steps // 2  # two train() calls: the tied copies must also be equal across a segment end
    losses = [s.loss for s in pipe.train(data[:half], half)]
    losses += [s.loss for s in pipe.train(data[half:], steps - half)]
    torch.save({"raw": pipe.host.state_dict(pipe.param_names),  # every copy this stage holds
                "checkpoint": pipe.state_dict(), "losses": losses},
               os.path.join(out_dir, f"stage{pipe.stage}.pt"))
