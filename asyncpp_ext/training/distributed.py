"""``asyncpp-train`` over real processes: stages x dp ranks, the shared Trainer on each.

The parent (the CLI) has already validated the configuration, the data and the run directory;
each rank builds the same model from the seed, keeps its stage, and runs the Trainer with a
``PipelineEngine``. Rank = replica * stages + stage (see pipeline/data_parallel.py). Every rank
draws the same global minibatches (microbatches of dp * B sequences) and its replica takes its
rows. Replica 0's last stage writes metrics.jsonl (its losses are the global means) and, under
torchrun, loss.png; a local launch draws loss.png in the parent once the ranks end (matplotlib's
import, half a second, is then not paid by a rank at every run's end);
checkpoints are collective: replica 0's ranks write one shard per stage (the replicas hold
identical state), its last stage seals the checkpoint (meta.json) once all shards are on disk.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..models.attention import attention_preference
from ..data import DataError
from .build import build_choice_sets, build_pipeline_engine, build_run_data, resume
from .stage_compute import stage_compute
from .async_checkpoint import BackgroundWriter, mark_done, take_snapshot, wait_for_marks
from .checkpoint import (begin_checkpoint, capture_rng_state, checkpoint_path, finalize_checkpoint,
                         restore_rng_state, shard_name, temp_checkpoint_path, write_shard)
from .config import ConfigError, RunConfig
from ..pipeline import Pipeline, init_distributed, spawn, under_launcher
from ..pipeline.devices import choose_transport, local_world_size, process_group_backend, rank_device
from ..pipeline.launch import (LaunchError, check_local_address, launcher, lost_a_peer, report_rank_failure,
                               spawned_locally)
from ..pipeline.watchdog import EXIT_PEER_LOST
from ..pipeline.start_method import start_method
from ..pipeline.ipc import slots_from_env
from ..pipeline.sockets import SocketSetupError, explicit_host, inline_recv_bytes, recv_spin_us
from ..pipeline.peer_errors import peer_failure
from ..pipeline.transport import TransportError
from . import stop_request
from .run_files import draw_losses_after_failure, plot_losses
from .trainer import Trainer


def _collective_checkpoint(pipe: Pipeline, run_dir: Path, keep: Optional[int] = None,
                           background: Optional[BackgroundWriter] = None, timeout_s: float = 300.0):
    """The checkpoint of every stage: each of replica 0's ranks writes its shard, the last stage's
    seals it. With ``background`` (--async-checkpoints) each writes from its thread and the sealing
    one waits for the others' marks there (async_checkpoint.py); otherwise barriers order it."""
    def barrier(what: str) -> None:
        try:
            dist.barrier()
        except RuntimeError as e:  # a peer died or stalled: this rank only reacts (launch.py)
            raise TransportError(f"stage {pipe.stage}: checkpoint of step {step_now[0]}: {what} "
                                 f"failed -- {peer_failure(e, 'a peer')}") from None

    step_now = [0]

    def save(step: int, meta: dict) -> Path:
        step_now[0] = step
        writer = pipe.host.is_last and pipe.replica == 0
        if background is not None:
            background.wait()  # this rank's share of the checkpoint before (and its seal, if it seals)
        tmp = begin_checkpoint(run_dir, step) if writer else None
        barrier("waiting for the temporary directory")
        tmp = tmp or temp_checkpoint_path(run_dir, step)
        if background is not None:
            if pipe.replica == 0:
                background.start(_shard_writer(pipe, run_dir, tmp, step, meta, keep, writer, timeout_s))
            return checkpoint_path(run_dir, step)
        if pipe.replica == 0:  # every replica holds the same state
            write_shard(tmp, pipe.stage, pipe.state_dict(), capture_rng_state())
        barrier("waiting for every shard")
        final = (finalize_checkpoint(run_dir, tmp, step, meta, keep) if writer
                 else checkpoint_path(run_dir, step))
        barrier("waiting for the checkpoint to be sealed")
        return final
    return save


def _shard_writer(pipe: Pipeline, run_dir: Path, tmp: Path, step: int, meta: dict, keep: Optional[int],
                  seals: bool, timeout_s: float):
    """--async-checkpoints: the write of this stage's shard (and, where ``seals``, the checkpoint's
    seal once every stage's shard is marked done), from a copy of the state taken now."""
    snapshot, rng = take_snapshot(pipe.stage, pipe.state_dict())
    shards = [shard_name(s) for s in range(pipe.stages)]

    def write() -> None:
        size, digest = write_shard(tmp, pipe.stage, snapshot, rng)
        mark_done(tmp / shard_name(pipe.stage), size, digest)
        if seals:
            try:
                hashed = wait_for_marks(tmp, shards, timeout_s)
            except TimeoutError as exc:
                raise TransportError(f"stage {pipe.stage}: checkpoint of step {step}: {exc} -- a peer has "
                                     "probably exited") from None
            finalize_checkpoint(run_dir, tmp, step, meta, keep, hashed)
    return write


def _agree_on_end(pipe: Pipeline):
    """--time-limit, --stop-on-signal: every rank ends the next segment at the earliest step any of
    them proposes, and learns whether any noted the stop signal (one all-reduce over the default
    group; the ranks' clocks and signals differ, their segments must not)."""
    def agree(end: int, noted: bool) -> tuple[int, bool]:
        proposal = torch.tensor([end, -int(noted)], dtype=torch.int64)  # the minimum of -noted: any
        try:
            dist.all_reduce(proposal, op=dist.ReduceOp.MIN)
        except RuntimeError as e:  # a peer died or stalled: this rank only reacts (launch.py)
            raise TransportError(f"stage {pipe.stage}: agreeing on the next segment's end (--time-limit, "
                                 f"--stop-on-signal) failed -- {peer_failure(e, 'a peer')}") from None
        return int(proposal[0]), bool(proposal[1] < 0)
    return agree


def rank_placement(cfg: RunConfig) -> tuple[str, str, str]:
    """(device, transport, default-group backend) of this process's rank (devices.py's rules):
    spawned ranks and torchrun's both number the ranks of a machine by LOCAL_RANK."""
    transport = choose_transport(cfg.pipeline.transport, cfg.train.device)
    device = cfg.train.device
    if device == "cuda":
        started_by = launcher()
        local_world = local_world_size(started_by, cfg.pipeline.stages * cfg.pipeline.dp, os.environ)
        device = rank_device(device, int(os.environ.get("LOCAL_RANK", "0")), local_world,
                             torch.cuda.device_count(), transport, started_by)
        torch.cuda.set_device(torch.device(device))  # before any CUDA work: NCCL binds to it
    return device, transport, process_group_backend(transport, device)


def check_same_data(stream) -> None:
    """Every rank reads the same training tokens (stage 0 the inputs, the last stage the targets,
    every replica its rows of one draw): their count, shards and fingerprint are compared over
    the world once, at start. On several nodes each reads its own copy of --data (and the builtin
    corpus is built from the Python installation's files), so they can differ."""
    state = stream.state_dict()
    mine = {k: state.get(k) for k in ("num_tokens", "shards", "fingerprint", "mix")}  # mix: each source's
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    other = next((r for r, theirs in enumerate(every) if theirs != every[0]), None)
    if other is not None:
        raise DataError(f"rank {other} reads other training data than rank 0 ({every[other]} against "
                        f"{every[0]}): every rank must read the same --data or --data-mix (on several nodes, the same "
                        "files on each; the builtin corpus depends on the Python installation)")


def rank_main(cfg_dict: dict, resume_dir: Optional[str], started_at: Optional[float] = None) -> None:
    """One rank of a pipeline run (under torchrun or spawned by ``launch``); ``started_at``: when
    the run's command started (Unix time), where --time-limit counts from."""
    cfg = RunConfig.from_dict(cfg_dict)
    with stop_request.noting(cfg.train.stop_signal):  # --stop-on-signal: noted for the trainer
        _rank_run(cfg, resume_dir, started_at)


def _rank_run(cfg: RunConfig, resume_dir: Optional[str], started_at: Optional[float]) -> None:
    device, transport, backend = rank_placement(cfg)
    init_distributed(cfg.train.timeout_s, backend=backend)
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // (cfg.pipeline.stages * cfg.pipeline.dp))
    torch.set_num_threads(threads)  # by default the ranks share the machine's cores
    p = cfg.pipeline
    # Every replica draws the same stream and takes its rows; every replica evaluates the whole
    # set (same weights, same numbers) so none waits for another.
    stream, eval_set, eval_sets = build_run_data(cfg)
    choice_sets = build_choice_sets(cfg)
    check_same_data(stream)
    compute = stage_compute(cfg, device)
    with attention_preference(compute.attention):  # as its --simulate run, from the compile on
        engine = build_pipeline_engine(cfg, device, transport, compute, first_weights=resume_dir is None)
        pipe = engine.pipe
        resumed = resume(engine, stream, Path(resume_dir) if resume_dir is not None else None, pipe.stage, p.stages,
                         skip_batches=cfg.data.skip_batches)
        if resumed.rng is not None:
            restore_rng_state(resumed.rng)
        run_dir = Path(cfg.train.out)
        writer = BackgroundWriter() if cfg.writes_checkpoints_async() else None  # --async-checkpoints
        writes_metrics = pipe.host.is_last and pipe.replica == 0
        trainer = Trainer(cfg, engine, stream, eval_set, run_dir, start_step=resumed.start_step,
                          elapsed_s=resumed.elapsed_s, device="cpu",
                          checkpoint_fn=_collective_checkpoint(pipe, run_dir, cfg.train.keep_checkpoints,
                                                               writer, cfg.train.timeout_s),
                          checkpoint_writer=writer,
                          writes_metrics=writes_metrics, draws_plot=writes_metrics and not spawned_locally(),
                          num_stages=p.stages,
                          agree_on_end=_agree_on_end(pipe), started_at=started_at, eval_sets=eval_sets,
                          choice_sets=choice_sets)
        with pipe:
            trainer.run()


def check_one_process_world(cfg: RunConfig) -> None:
    """A run of one process (``--simulate``, or one stage and one replica) under a torchrun of more:
    every rank would train the same run into the same --out (the second found it in use and the
    launcher stopped the first part-way), so it is refused on every rank before anything is written."""
    if not under_launcher() or spawned_locally():
        return
    world = int(os.environ["WORLD_SIZE"])
    if world == 1:
        return
    what = ("--simulate runs in one process" if cfg.train.simulate else
            f"--stages {cfg.pipeline.stages} x --dp {cfg.pipeline.dp} is one process")
    raise ConfigError(f"{what}, but torchrun started {world}; run it without torchrun (or with "
                      f"--nproc-per-node 1), or give --stages / --dp for {world} processes"
                      + (" and drop --simulate" if cfg.train.simulate else ""))


def launch(cfg: RunConfig, resume_dir: Optional[Path], prepare, started_at: Optional[float] = None) -> None:
    """Run the pipeline under torchrun's world, or spawn ``stages * dp`` local ranks on 127.0.0.1.

    ``prepare()`` creates the run directory and config.json: here in the parent for a local
    launch, on rank 0 (the others wait) under torchrun. ``started_at``: rank_main's."""
    args = (cfg.to_dict(), str(resume_dir) if resume_dir is not None else None, started_at)
    try:  # a bad ASYNCPP_START_METHOD, RECV_SPIN_US, INLINE_RECV_BYTES, IPC_SLOTS, SOCKET_HOST or a
        recv_spin_us()  # local MASTER_ADDR stops the run before anything is written (the ranks read them again)
        inline_recv_bytes()
        slots_from_env()
        explicit_host()
        if not under_launcher():
            start_method()
            check_local_address()
    except (ValueError, SocketSetupError) as exc:
        raise ConfigError(str(exc)) from None
    if not under_launcher():
        prepare()
        # --stop-on-signal: the signal, sent to this process, is passed on to every rank
        forward = (cfg.train.stop_signal,) if cfg.train.stop_signal else ()
        try:
            spawn(rank_main, cfg.pipeline.stages * cfg.pipeline.dp, args, forward=forward)
        except LaunchError:
            draw_losses_after_failure(cfg.train.out)
            raise
        plot_losses(cfg.train.out)
        return
    try:  # torchrun's world: its rendezvous waits --timeout for the other ranks, no longer
        rank, world = init_distributed(cfg.train.timeout_s, backend=rank_placement(cfg)[2])
    except (RuntimeError, ValueError, OSError) as exc:  # torch's store and socket errors: one line
        from .run import RunSetupError
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise RunSetupError(f"torchrun's process group did not form within --timeout {cfg.train.timeout_s:g} s "
                            f"({reason}); start every rank (--nproc-per-node times --nnodes) with the same "
                            "MASTER_ADDR and MASTER_PORT") from None
    need = cfg.pipeline.stages * cfg.pipeline.dp
    if world != need:
        raise ConfigError(f"torchrun started {world} processes but --stages {cfg.pipeline.stages} x --dp "
                         f"{cfg.pipeline.dp} needs {need}; start {need} processes in all (--nproc-per-node "
                         f"times --nnodes) or change --stages / --dp")
    # Rank 0 makes (or checks) the run directory; the others learn whether it could, and end with
    # its reason rather than wait until torchrun stops them (a stopped rank would point at the
    # --out of the run that holds it: "continue with --resume").
    failure = None
    if rank == 0:
        try:
            prepare()
        except Exception as exc:
            failure = exc
    outcome = [None if failure is None else " ".join(str(failure).split()) or type(failure).__name__]
    dist.broadcast_object_list(outcome, src=0, device=torch.device("cpu"))
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        from .run import RunSetupError
        raise RunSetupError(f"rank 0 could not start the run: {outcome[0]}")
    try:
        rank_main(*args)
    except Exception as e:
        if not lost_a_peer(e):
            raise  # the command's own message (a NaN stop, a full disk, ...)
        report_rank_failure(rank, e)  # a consequence of another rank's failure: its line, as spawned ranks do
        raise SystemExit(EXIT_PEER_LOST) from None
