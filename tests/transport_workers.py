"""Worker functions for the transport tests (importable by spawned ranks)."""
import json
import os

import torch
import torch.nn as nn

import pipeline_workers as w
from asyncpp_ext.pipeline import Pipeline, init_distributed
from asyncpp_ext.pipeline.transport import GlooTransport


def staged_train_worker(transport: str, force_staging: bool, steps: int, out_dir: str) -> None:
    """2bw on the shared 4-block model; ``force_staging`` sends every CPU tensor through the host
    staging path a CUDA tensor takes (a receive lands in a separate host tensor and is copied into
    the stage's buffer when its completion is seen)."""
    init_distributed(60)
    torch.set_num_threads(1)
    if force_staging:
        GlooTransport._staged = lambda self, tensor: True
    m = 2
    pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("adamw"),
                    schedule="2bw", microbatches=m, transport=transport, timeout_s=60)
    losses = [s.loss for s in pipe.train(w.batches(steps, m), steps)]
    if pipe.host.is_last:
        name = f"losses_{transport}_{'staged' if force_staging else 'direct'}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(losses, f)


def peer_exits_worker(transport: str) -> None:
    """Stage 1 leaves after one step; stage 0's transfers must fail naming the peer."""
    init_distributed(30)
    m = 2
    pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("sgd"),
                    schedule="2bw", microbatches=m, transport=transport, timeout_s=30)
    steps = 1 if pipe.stage == 1 else 20
    for _ in pipe.train(w.batches(steps, m), steps):
        pass
    if pipe.stage == 1:
        os._exit(0)
