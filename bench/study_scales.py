"""The scales bench/paper_study.py runs its tables at: how big each run is, on what device, for
how long, and which rows a table keeps there.

    cpu       the default: the 4-layer byte-level GPT on two CPU cores, 60-200 steps per table
    cpu-long  the ef table for Muon, 10x the default's steps (1200), eval every 100 steps: does
              EF's share of the gap grow as training goes on? (~35-60 min on two cores)
    gpu       the optimizers, ef and mitigations tables on a 56M-parameter Llama-family model over
              a BPE corpus built on the machine (bench/study_corpus.py), warmup + cosine, 2 seeds,
              sized for <= 20 minutes per table on one H100 (CUDA only)

A scale is data: a table's steps, seeds, batch, model and the config fields every run sets
(``overrides``, dotted RunConfig fields as in ``--set``). ``--steps``, ``--seeds``, ``--model``
and ``--set`` still override a scale's values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

GPU_MODEL = {"model.n_layer": 10, "model.n_embd": 640, "model.n_head": 10, "model.n_kv_head": 5,
             "model.intermediate_size": 1728, "model.seq_len": 512, "model.tie_embeddings": True}
"""The gpu scale's model, on the llama-tiny preset (Llama: RMSNorm, rotary, SwiGLU, grouped-query
attention, tied embedding): 10 blocks of width 640; with the corpus's 16,384-id vocabulary 56.0M
parameters (45.5M besides the tied embedding), at the low end of the paper-scale range (50-360M)
so that a run trains long enough to flatten within a 20-minute table."""
GPU_VOCAB = 16384
"""BPE vocabulary of the corpus the gpu scale builds (bench/study_corpus.py)."""


@dataclass(frozen=True)
class Scale:
    """The size of every run of a table at one scale."""

    name: str
    """``--scale`` value."""
    tables: tuple[str, ...]
    """Tables defined at this scale; another is refused."""
    steps: Mapping[str, int] = field(default_factory=dict)
    """Steps per table (missing: the table's own default)."""
    eval_every: Optional[int] = None
    """Evaluation period in steps (None: steps // 5)."""
    seeds: int = 3
    """Paired seeds."""
    model: Optional[str] = None
    """Model preset (None: the table's GPT preset)."""
    microbatches: int = 2
    """Microbatches per step."""
    micro_batch_size: int = 8
    """Sequences per microbatch."""
    eval_batches: int = 8
    """Batches of micro_batch_size windows per evaluation."""
    ef_rows: Optional[tuple[tuple[float, str], ...]] = None
    """(beta, source) rows of the ef table (None: the full beta x source grid)."""
    optimizers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Optimizers per table (missing: the table's own)."""
    overrides: Mapping[str, object] = field(default_factory=dict)
    """Config fields every run sets (dotted RunConfig fields)."""
    device: str = "cpu"
    """Where the runs train."""
    workers: int = 2
    """Runs at once."""
    threads: int = 1
    """Torch threads per worker."""
    data: str = "builtin"
    """Default ``--data``: "builtin" or "corpus" (build or reuse the scale's BPE corpus)."""
    warmup_share: float = 0.0
    """Linear warmup over this share of the steps (``optim.warmup_steps``; 0: none)."""


SCALES = {
    "cpu": Scale("cpu", tables=("optimizers", "ef", "mitigations", "momentum", "sensitivity")),
    "cpu-long": Scale(
        "cpu-long", tables=("ef",), steps={"ef": 1200}, eval_every=100,
        # beta 0.25/0.75 left out (0.25 recovers least, 0.75 sits between 0.5 and 1 at 120 steps);
        # 1.5 added: the best mean over 200 steps of tinyshakespeare (docs/paper_reproduction.md).
        ef_rows=((0.5, "buffer"), (1.0, "buffer"), (1.5, "buffer"), (0.5, "weights"), (1.0, "weights"))),
    "gpu": Scale(
        "gpu", tables=("optimizers", "ef", "mitigations"), device="cuda", model="llama-tiny", seeds=2,
        steps={"optimizers": 1500, "ef": 1500, "mitigations": 1000}, eval_every=100,
        microbatches=4, micro_batch_size=8, eval_batches=16, workers=2, threads=4, data="corpus",
        ef_rows=((0.5, "buffer"), (1.0, "buffer"), (1.0, "weights")),
        optimizers={"optimizers": ("adamw", "muon", "normuon"), "ef": ("muon",), "mitigations": ("muon", "adamw")},
        overrides={**GPU_MODEL, "model.vocab_size": GPU_VOCAB, "optim.lr_schedule": "cosine",
                   "train.dtype": "bf16", "data.sampling": "epoch"}, warmup_share=0.05),
}
"""Every scale by name."""

__all__ = ["GPU_MODEL", "GPU_VOCAB", "Scale", "SCALES"]
