"""``asyncpp-eval --choices FILE``: multiple-choice accuracy of checkpoints (HellaSwag and alike).

A task file is JSON lines, one example each: ``{"context": "...", "endings": ["...", ...],
"label": i}`` (HellaSwag's own ``hellaswag_val.jsonl`` reads as it is: its context is ``"ctx"``).
Each ending is scored by the log-likelihood the model gives its tokens after the context's,
``sum_i log p(e_i | context, e_<i)``: the context and the ending are encoded apart with the run's
tokenizer (the ending with a space in front where neither side has whitespace there, as the
sentence would be written), joined after the token that starts a document where the tokenizer has
one (its end-of-text token, else its beginning-of-text token, as training's documents follow one
and asyncpp-sample starts from one; bytes have none), and cut to the model's last ``seq_len`` + 1
tokens. The
example counts as right when the label's ending is the most likely (``accuracy``) and, for
``accuracy_norm``, the most likely per UTF-8 byte of the ending (lm-evaluation-harness's
``acc_norm``: longer endings are not penalised for their length, whatever the tokenizer).
The endings of one example run as one padded batch; padding sits after each ending, where a
causal model's scores of the tokens before it cannot see it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..command_line import UsageError


@dataclass(frozen=True)
class Example:
    context: str
    endings: tuple
    label: int


def read_choices(path: str, limit=None) -> list[Example]:
    """The examples of a task file (the first ``limit``); UsageError naming the file and line of
    the first that is not one."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--choices {path}: no such file; pass a JSON-lines file of "
                         '{"context", "endings", "label"} examples')
    examples = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if limit is not None and len(examples) == limit:
                break
            examples.append(_example(line, f"--choices {path}, line {number}"))
    if not examples:
        raise UsageError(f"--choices {path} holds no examples")
    return examples


def _example(line: str, where: str) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: an example must be a JSON object")
    context = record.get("context", record.get("ctx"))
    endings, label = record.get("endings"), record.get("label")
    if isinstance(label, str) and label.strip().isdigit():  # some copies write it as a string
        label = int(label)
    if not isinstance(context, str) or not context.strip():
        raise UsageError(f"{where}: needs a non-empty \"context\" (or \"ctx\") string")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e for e in endings):
        raise UsageError(f"{where}: needs \"endings\", a list of at least 2 non-empty strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise UsageError(f"{where}: \"label\" must be the index of the right ending, 0..{len(endings) - 1}; "
                         f"got {label!r}")
    return Example(context, tuple(endings), label)


def document_start(tokenizer) -> list[int]:
    """The ids that start a document for ``tokenizer``: its end-of-text token, else its
    beginning-of-text token; none for bytes (asyncpp-sample starts a new document the same way)."""
    _, eos, bos = tokenizer.boundary_tokens()
    token = eos or bos
    return [int(tokenizer.token_to_id(token))] if token is not None else []


def ending_text(context: str, ending: str) -> str:
    """The ending as it follows the context: a space in front where neither side has whitespace."""
    return ending if context[-1:].isspace() or ending[:1].isspace() else " " + ending


@torch.no_grad()
def ending_log_likelihoods(model, encode, example: Example, seq_len: int, device, prefix=()) -> list[float]:
    """``sum_i log p(e_i | context, e_<i)`` of each ending (the module docstring); ``prefix``: ids
    before the context (the token that starts a document)."""
    context = list(prefix) + encode(example.context)
    rows, scored = [], []
    for ending in example.endings:
        tail = encode(ending_text(example.context, ending))
        ids = (context + tail)[-(seq_len + 1):]  # the window's last seq_len + 1 tokens
        rows.append(ids)
        scored.append(min(len(tail), len(ids) - 1))  # the window's first token has no prediction
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for i, ids in enumerate(rows):
        batch[i, :len(ids)] = torch.tensor(ids)
    batch = batch.to(device)
    out = model(batch[:, :-1])
    logits = (out[0] if isinstance(out, tuple) else out).float()
    losses = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # (B, T)
    totals = []
    for i, ids in enumerate(rows):
        end = len(ids) - 1  # targets 0..end-1 are real; the ending's are the last `scored` of them
        totals.append(-float(losses[i, end - scored[i]:end].double().sum()))
    return totals


def score_choices(model, encode, examples: list, seq_len: int, device, precision, prefix=()) -> dict:
    """accuracy and accuracy_norm of ``model`` over ``examples`` (module docstring)."""
    right = right_norm = 0
    start = time.perf_counter()
    for example in examples:
        with precision:
            totals = ending_log_likelihoods(model, encode, example, seq_len, device, prefix)
        per_byte = [t / len(ending_text(example.context, e).encode("utf-8"))
                    for t, e in zip(totals, example.endings)]
        right += max(range(len(totals)), key=totals.__getitem__) == example.label
        right_norm += max(range(len(per_byte)), key=per_byte.__getitem__) == example.label
    return {"examples": len(examples), "accuracy": right / len(examples), "accuracy_norm": right_norm / len(examples),
            "seconds": time.perf_counter() - start}


__all__ = ["Example", "read_choices", "document_start", "ending_text", "ending_log_likelihoods", "score_choices"]
