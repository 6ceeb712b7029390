"""Worker functions for the PP x DP tests (importable by spawned ranks).

One spawn runs several pipeline configurations in turn inside the same world, so the slow part
(starting processes and importing torch) is paid once per world size.
"""
import functools
import os

import torch
import torch.distributed as dist

from asyncpp_ext.models import GPT, GPTConfig
from asyncpp_ext.models.registry import ModelConfig, build_model
from asyncpp_ext.optim import build_optimizer
from asyncpp_ext.pipeline import Pipeline, init_distributed

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16)
# bias-free linear layers (the fused weight gradients' kind), same vocabulary and context
LLAMA = ModelConfig(arch="llama", vocab_size=CONFIG.vocab_size, seq_len=CONFIG.seq_len, n_layer=2, n_embd=32,
                    n_head=2, n_kv_head=1, intermediate_size=64, tie_embeddings=False, rope_theta=10000.0,
                    norm_eps=1e-5)
GLOBAL_MICRO_BATCH = 4   # sequences per microbatch over all replicas
MICROBATCHES = 4
ADAMW_LR = 3e-3          # the hybrid's AdamW part (embeddings, head, vectors)


def global_batches(steps: int, seed: int = 3):
    """The same global minibatches on every rank: m microbatches of GLOBAL_MICRO_BATCH sequences."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        shape = (MICROBATCHES * GLOBAL_MICRO_BATCH, CONFIG.seq_len)
        yield (torch.randint(0, CONFIG.vocab_size, shape, generator=g),
               torch.randint(0, CONFIG.vocab_size, shape, generator=g))


def muon_factory(module):
    return build_optimizer(module, "muon", 0.02, ef_beta=0.5, weight_decay=0.01, adamw_lr=ADAMW_LR)


def run_configs(configs: list, steps: int, out_dir: str) -> None:
    """Every rank runs each (name, Pipeline kwargs) in order; each rank saves what it saw."""
    init_distributed(120)
    torch.set_num_threads(1)
    results = {}
    for name, kwargs in configs:
        kwargs = dict(kwargs)
        model = build_model(LLAMA, seed=0) if kwargs.pop("llama", False) else GPT(CONFIG, seed=0)
        if "freeze" in kwargs:  # a parameter that trains not at all (no gradient, no hook)
            dict(model.named_parameters())[kwargs.pop("freeze")].requires_grad_(False)
        if not kwargs.pop("announce", True):  # the reference: every bucket started after the backward
            from asyncpp_ext.pipeline.compute_copies import ComputeCopies
            ComputeCopies.announce_final_grads = lambda self, on_final: None
        import asyncpp_ext.pipeline.stage as stage_module
        averager = stage_module.GradientAverager
        if "bucket_bytes" in kwargs:  # several buckets for these tiny stages (the default fits one)
            stage_module.GradientAverager = functools.partial(averager, bucket_bytes=kwargs.pop("bucket_bytes"))
        try:
            pipe = Pipeline(model, loss_fn=type(model).loss, optimizer=muon_factory,
                            microbatches=MICROBATCHES, track_memory=True, **kwargs)
        finally:
            stage_module.GradientAverager = averager
        losses = [s.loss for s in pipe.train(global_batches(steps), steps)]
        x, y = next(global_batches(1, seed=9))
        eval_loss = pipe.evaluate(list(zip(x.split(GLOBAL_MICRO_BATCH), y.split(GLOBAL_MICRO_BATCH)))[:2])
        state = pipe.state_dict()
        results[name] = {"replica": pipe.replica, "stage": pipe.stage, "losses": losses, "eval": eval_loss,
                         "params": state["params"], "memory": pipe.host.memory_report(),
                         "orthogonalized": getattr(pipe.host.optimizer, "orthogonalized_last_step", None),
                         "optimizer_scans_grads": pipe.host.optimizer.check_finite,
                         "hook_launches": getattr(pipe.host.grad_sync, "hook_launches", None),
                         "buckets": len(getattr(pipe.host.grad_sync, "ranges", ())),
                         "compute_copies": pipe.host.copies is not None}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
