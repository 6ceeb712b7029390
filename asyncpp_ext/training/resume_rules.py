"""What a resume and ``--init-from`` compare between a checkpoint's config and the run's: the fields
that must match (``RESUME_MUST_MATCH``, read by checkpoint.check_resume_config), the model fields
that shape a weight (``init_from_mismatch``), and "auto" precisions compared as what they run at."""
from __future__ import annotations

from dataclasses import fields
from typing import Optional

from ..precision import auto_precision_name
from .config import MUON_FAMILY, DataConfig, ModelConfig, OptimConfig, RunConfig

# Fields that change the numbers a run produces: a checkpoint resumed under a different value of
# any of them would not continue the same run. stages may differ (checkpoints are keyed by global
# parameter names, and the update semantics do not depend on the split), and so may dp and
# micro_batch_size as long as their product, the sequences the stream draws per microbatch, stays:
# every replica holds the same state, and R replicas of B sequences average the gradient of the
# same R*B sequences (equal up to float summation order). data.eval_batches may differ too: it
# says how much of the held-out split an evaluation reads, not what trains. So may the data's
# paths (data.source, data.val_source): a relative path read from another directory, or data
# moved, is the same data, and what trains is compared itself (the stream's token count, shards
# and fingerprint, data/batches.py; a mixture's weights and each source's, data/mixture.py), while
# --val-data, --eval-data and --eval-choices only say what is evaluated (and --change-data-mix lets the mixture
# change at that resume: the stream keeps the phases it ran).
RESUME_MAY_DIFFER_DATA = ("eval_batches", "source", "val_source", "mix", "eval_data", "eval_choices",
                          "eval_choices_limit", "change_mix", "skip_batches")
RESUME_MUST_MATCH = (
    [f"model.{f.name}" for f in fields(ModelConfig)]
    + [f"data.{f.name}" for f in fields(DataConfig) if f.name not in RESUME_MAY_DIFFER_DATA]
    + [f"optim.{f.name}" for f in fields(OptimConfig)]
    + ["pipeline.schedule", "pipeline.microbatches", "pipeline.global_micro_batch_size", "pipeline.delay",
       "pipeline.delay_only", "train.seed", "train.dtype", "train.document_mask"]
)


def init_from_mismatch(saved: ModelConfig, model: ModelConfig) -> Optional[str]:
    """Why a run of ``model`` cannot start from the weights of a checkpoint of ``saved`` (None if it
    can): every field that shapes a weight must agree. ``init_std`` and ``hf_model`` (where the
    first weights came from) do not count, nor ``seq_len`` but for the GPT (whose position table it
    sizes; Llama's rotary tables and a Hugging Face model's window are computed, not stored)."""
    free = {"init_std", "hf_model"} | (set() if model.arch == "gpt" else {"seq_len"})
    for f in fields(ModelConfig):
        before, now = getattr(saved, f.name), getattr(model, f.name)
        if f.name in free or before == now:
            continue
        if f.name == "hf_config":
            return "its Hugging Face config differs from this run's"
        return f"its model has {f.name}={before!r}, this run's {now!r}"
    return None


def get_field(cfg: RunConfig, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def resolved_field(cfg: RunConfig, dotted: str):
    """``get_field``, with the batch order's seed as it is (``RunConfig.data_seed``), --document-mask's
    "data" as the token id the data records, and an "auto"
    precision replaced by what it runs as on ``cfg``'s device
    (bf16 on cuda, fp32 on cpu): the autocast dtype, and a Muon-family optimizer's Newton-Schulz
    dtype. A resume compares these, so "auto" on cpu and "fp32" count as the same run and "auto" on
    cpu and on cuda do not."""
    value = get_field(cfg, dotted)
    if dotted == "train.document_mask" and value == "data":  # the data's boundary token: the id it names
        from .stage_compute import document_boundary
        try:
            return document_boundary(cfg)
        except ValueError:  # the start's own checks say what is wrong with the data
            return value
    if dotted == "data.seed" and value is None:  # the order's seed is the run's (older configs: no field)
        return cfg.train.seed
    auto_precision = dotted == "train.dtype" or (dotted == "optim.ns_dtype" and cfg.optim.name in MUON_FAMILY)
    if value == "auto" and auto_precision:
        return auto_precision_name(cfg.train.device)
    return value


__all__ = ["RESUME_MAY_DIFFER_DATA", "RESUME_MUST_MATCH", "init_from_mismatch", "get_field", "resolved_field"]
