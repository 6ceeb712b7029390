"""``asyncpp-train`` over real processes: stages x dp ranks, the shared Trainer on each.

The parent (the CLI) has already validated the configuration, the data and the run directory;
each rank builds the same model from the seed, keeps its stage, and runs the Trainer with a
``PipelineEngine``. Rank = replica * stages + stage (see pipeline/data_parallel.py). Every rank
draws the same global minibatches (microbatches of dp * B sequences) and its replica takes its
rows. Replica 0's last stage writes metrics.jsonl and loss.png (its losses are the global means);
checkpoints are collective: replica 0's ranks write one shard per stage (the replicas hold
identical state), its last stage seals the checkpoint (meta.json) once all shards are on disk.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .checkpoint import (begin_checkpoint, capture_rng_state, checkpoint_path, finalize_checkpoint,
                         load_checkpoint, restore_rng_state, temp_checkpoint_path, write_shard)
from .config import ConfigError, RunConfig
from ..data import BatchStream
from ..models.registry import build_model
from ..pipeline import Pipeline, init_distributed, spawn, under_launcher
from ..pipeline.devices import choose_transport, local_world_size, process_group_backend, rank_device
from ..pipeline.launch import spawned_locally, start_method
from ..pipeline.sockets import recv_spin_us
from ..pipeline.transport import TransportError, peer_failure_reason
from .simulate import merge_engine_states
from .trainer import StepOutcome, Trainer, run_data


class PipelineEngine:
    """StepEngine over a Pipeline: each ``train_steps`` call is one continuous stream."""

    def __init__(self, pipe: Pipeline):
        self.pipe = pipe
        self.stage, self.replica = pipe.stage, pipe.replica
        self._shares_since_ns = 0  # trace entries that started before this are summarised

    def time_shares(self):
        """This stage's compute and wait shares since the last call (TensorBoard)."""
        from .tensorboard_log import stage_time_shares

        recent = []
        for entry in reversed(self.pipe.trace):  # (op, step, mb, version, start_ns, end_ns)
            if entry[4] < self._shares_since_ns:
                break
            recent.append(entry)
        if not recent:
            return None
        self._shares_since_ns = max(e[5] for e in recent) + 1
        return stage_time_shares(recent[::-1])

    def train_steps(self, stream: BatchStream, steps: int):
        minibatches = (stream.next() for _ in range(steps))
        for stats in self.pipe.train(minibatches, steps):
            yield StepOutcome(stats.loss, True) if stats.skipped else stats.loss

    def eval_loss(self, batches):
        return self.pipe.evaluate(batches)

    def state_dict(self) -> dict:
        return self.pipe.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pipe.load_state_dict(state)


def _collective_checkpoint(pipe: Pipeline, run_dir: Path):
    def barrier(what: str) -> None:
        try:
            dist.barrier()
        except RuntimeError as e:  # a peer died or stalled: this rank only reacts (launch.py)
            raise TransportError(f"stage {pipe.stage}: checkpoint of step {step_now[0]}: {what} "
                                 f"failed -- a peer has probably exited: {peer_failure_reason(e)}") from None

    step_now = [0]

    def save(step: int, meta: dict) -> Path:
        step_now[0] = step
        writer = pipe.host.is_last and pipe.replica == 0
        tmp = begin_checkpoint(run_dir, step) if writer else None
        barrier("waiting for the temporary directory")
        tmp = tmp or temp_checkpoint_path(run_dir, step)
        if pipe.replica == 0:  # every replica holds the same state
            write_shard(tmp, pipe.stage, pipe.state_dict(), capture_rng_state())
        barrier("waiting for every shard")
        final = finalize_checkpoint(run_dir, tmp, step, meta) if writer else checkpoint_path(run_dir, step)
        barrier("waiting for the checkpoint to be sealed")
        return final
    return save


def rank_placement(cfg: RunConfig) -> tuple[str, str, str]:
    """(device, transport, default-group backend) of this process's rank (devices.py's rules):
    spawned ranks and torchrun's both number the ranks of a machine by LOCAL_RANK."""
    transport = choose_transport(cfg.pipeline.transport, cfg.train.device)
    device = cfg.train.device
    if device == "cuda":
        launcher = "spawn" if spawned_locally() else "torchrun"
        local_world = local_world_size(launcher, cfg.pipeline.stages * cfg.pipeline.dp, os.environ)
        device = rank_device(device, int(os.environ.get("LOCAL_RANK", "0")), local_world,
                             torch.cuda.device_count(), transport, launcher)
        torch.cuda.set_device(torch.device(device))  # before any CUDA work: NCCL binds to it
    return device, transport, process_group_backend(transport, device)


def rank_main(cfg_dict: dict, resume_dir: Optional[str], factory_builder) -> None:
    """One rank of a pipeline run (under torchrun or spawned by ``run_pipeline``)."""
    cfg = RunConfig.from_dict(cfg_dict)
    device, transport, backend = rank_placement(cfg)
    init_distributed(cfg.train.timeout_s, backend=backend)
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // (cfg.pipeline.stages * cfg.pipeline.dp))
    torch.set_num_threads(threads)  # by default the ranks share the machine's cores
    p = cfg.pipeline
    # Every replica draws the same stream and takes its rows; every replica evaluates the whole
    # set (same weights, same numbers) so none waits for another.
    stream, eval_set = run_data(cfg)
    model = build_model(cfg.model, seed=cfg.train.seed)
    pipe = Pipeline(model, loss_fn=type(model).loss, optimizer=factory_builder(cfg), schedule=p.schedule,
                    microbatches=p.microbatches, stages=p.stages, dp=p.dp, shard_optimizer=p.shard_muon,
                    recompute=p.recompute, dtype=cfg.train.dtype, device=device, transport=transport,
                    timeout_s=cfg.train.timeout_s, on_nonfinite=cfg.train.on_nonfinite,
                    lr_schedule=cfg.lr_schedule(), clip_grad_norm=cfg.optim.clip_grad_norm,
                    **cfg.mitigation_kwargs())
    engine = PipelineEngine(pipe)
    start_step, elapsed = 0, 0.0
    if resume_dir is not None:
        meta, shards = load_checkpoint(resume_dir)
        engine.load_state_dict(merge_engine_states([s["engine"] for s in shards]))
        stream.load_state_dict(meta["data"])
        start_step, elapsed = int(meta["step"]), float(meta.get("elapsed_s", 0.0))
        same_depth = len(shards) == p.stages
        restore_rng_state(shards[pipe.stage if same_depth else 0]["rng"])
    run_dir = Path(cfg.train.out)
    trainer = Trainer(cfg, engine, stream, eval_set, run_dir, start_step=start_step, elapsed_s=elapsed,
                      device="cpu", checkpoint_fn=_collective_checkpoint(pipe, run_dir),
                      writes_metrics=pipe.host.is_last and pipe.replica == 0, num_stages=p.stages)
    with pipe:
        trainer.run()


def launch(cfg: RunConfig, resume_dir: Optional[Path], factory_builder, prepare) -> None:
    """Run the pipeline under torchrun's world, or spawn ``stages * dp`` local ranks on 127.0.0.1.

    ``prepare()`` creates the run directory and config.json: here in the parent for a local
    launch, on rank 0 (the others wait) under torchrun."""
    args = (cfg.to_dict(), str(resume_dir) if resume_dir is not None else None, factory_builder)
    try:  # a bad ASYNCPP_START_METHOD or ASYNCPP_RECV_SPIN_US stops the run before anything is written
        recv_spin_us()
        if not under_launcher():
            start_method()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not under_launcher():
        prepare()
        spawn(rank_main, cfg.pipeline.stages * cfg.pipeline.dp, args)
        return
    rank, world = init_distributed(backend=rank_placement(cfg)[2])
    need = cfg.pipeline.stages * cfg.pipeline.dp
    if world != need:
        raise ConfigError(f"torchrun started {world} processes but --stages {cfg.pipeline.stages} x --dp "
                         f"{cfg.pipeline.dp} needs {need}; start {need} processes in all (--nproc-per-node "
                         f"times --nnodes) or change --stages / --dp")
    if rank == 0:
        prepare()
    dist.barrier()
    rank_main(*args)
