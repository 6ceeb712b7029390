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
causal model's scores of the tokens before it cannot see it. A run trained with --document-mask is
scored attending within documents as it trained.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..command_line import UsageError
from ..models.document_mask import within_documents


@dataclass(frozen=True)
class Example:
    context: str
    endings: tuple
    label: int


def read_choices(path: str, limit=None, flag: str = "--choices") -> list[Example]:
    """The examples of a task file (the first ``limit``); UsageError naming ``flag``, the file and
    the line of the first that is not one."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{flag} {path}: no such file; pass a JSON-lines file of "
                         '{"context", "endings", "label"} examples')
    examples = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if limit is not None and len(examples) == limit:
                break
            examples.append(_example(line, f"{flag} {path}, line {number}"))
    if not examples:
        raise UsageError(f"{flag} {path} holds no examples")
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


def ending_rows(encode, example: Example, seq_len: int, prefix=()) -> list[tuple[list, int]]:
    """Each ending's window and how many of its last targets are the ending's: (ids, scored), ids
    the last ``seq_len`` + 1 tokens of prefix + context + ending (the module docstring)."""
    context = list(prefix) + encode(example.context)
    rows = []
    for ending in example.endings:
        tail = encode(ending_text(example.context, ending))
        ids = (context + tail)[-(seq_len + 1):]  # the window's last seq_len + 1 tokens
        rows.append((ids, min(len(tail), len(ids) - 1)))  # the window's first token has no prediction
    return rows


@torch.no_grad()
def ending_log_likelihoods(model, encode, example: Example, seq_len: int, device, prefix=(),
                           boundary: Optional[int] = None) -> list[float]:
    """``sum_i log p(e_i | context, e_<i)`` of each ending (the module docstring); ``prefix``: ids
    before the context (the token that starts a document); ``boundary``: the run's --document-mask
    token, attended within as it trained (and as training's --eval-choices rows are scored)."""
    rows, scored = zip(*ending_rows(encode, example, seq_len, prefix))
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for i, ids in enumerate(rows):
        batch[i, :len(ids)] = torch.tensor(ids)
    batch = batch.to(device)
    with within_documents(batch[:, :-1], boundary):  # right padding: after every real token
        out = model(batch[:, :-1])
    logits = (out[0] if isinstance(out, tuple) else out).float()
    losses = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # (B, T)
    totals = []
    for i, ids in enumerate(rows):
        end = len(ids) - 1  # targets 0..end-1 are real; the ending's are the last `scored` of them
        totals.append(-float(losses[i, end - scored[i]:end].double().sum()))
    return totals


def choice_scores(examples: list, totals: list) -> dict:
    """accuracy and accuracy_norm (module docstring) from each example's endings' log-likelihoods
    ``totals``, and ``right_loglik``: the mean log-likelihood of the right endings (a figure that
    moves while a young model's accuracy still sits at chance)."""
    right = right_norm = 0
    for example, sums in zip(examples, totals):
        per_byte = [t / len(ending_text(example.context, e).encode("utf-8")) for t, e in zip(sums, example.endings)]
        right += max(range(len(sums)), key=sums.__getitem__) == example.label
        right_norm += max(range(len(per_byte)), key=per_byte.__getitem__) == example.label
    n = len(examples)
    return {"examples": n, "accuracy": right / n, "accuracy_norm": right_norm / n,
            "right_loglik": sum(sums[e.label] for e, sums in zip(examples, totals)) / n}


IGNORE = -100  # F.cross_entropy's ignore_index: a target that is not the ending's


WIDTH_STEP = 64
"""A task's rows are as long as its longest window, rounded up to a multiple of this (at most the
model's seq_len): few shapes to compile, tiles that fill a GPU's matrix units."""


@dataclass
class ChoiceSet:
    """A task's endings as training evaluates them (``--eval-choices``): every ending's window one
    row of (batch_size, width) batches -- width the longest window's, rounded up by WIDTH_STEP: a
    HellaSwag window is ~100 tokens, not seq_len -- its inputs right-padded, its targets
    ``IGNORE`` but for the ending's tokens, so that a row's summed cross entropy is minus the
    ending's log-likelihood (rows past the last ending: every target ignored, a sum of 0).
    ``score`` turns the engine's row sums into the task's figures."""
    examples: list
    batches: list

    def score(self, row_losses) -> dict:
        totals, i = [], 0
        for example in self.examples:
            n = len(example.endings)
            totals.append([-float(x) for x in row_losses[i:i + n]])
            i += n
        return choice_scores(self.examples, totals)


def choice_set(examples: list, encode, seq_len: int, batch_size: int, prefix=()) -> ChoiceSet:
    """The ``ChoiceSet`` of ``examples`` for a model of ``seq_len`` fed ``batch_size`` rows."""
    rows = [row for example in examples for row in ending_rows(encode, example, seq_len, prefix)]
    count = -(-len(rows) // batch_size) * batch_size
    longest = max(len(ids) - 1 for ids, _ in rows)
    width = min(seq_len, -(-longest // WIDTH_STEP) * WIDTH_STEP)
    x = torch.zeros(count, width, dtype=torch.long)
    y = torch.full((count, width), IGNORE, dtype=torch.long)
    for i, (ids, scored) in enumerate(rows):
        n = len(ids) - 1  # inputs ids[:-1], targets ids[1:]; the ending's: the last `scored`
        x[i, :n] = torch.tensor(ids[:-1])
        y[i, n - scored:n] = torch.tensor(ids[n + 1 - scored:])
    return ChoiceSet(examples, [(x[s:s + batch_size], y[s:s + batch_size]) for s in range(0, count, batch_size)])


def score_choices(model, encode, examples: list, seq_len: int, device, precision, prefix=(),
                  boundary: Optional[int] = None) -> dict:
    """accuracy and accuracy_norm of ``model`` over ``examples`` (module docstring), attending
    within documents for a ``boundary`` token (ending_log_likelihoods)."""
    start = time.perf_counter()
    totals = []
    for example in examples:
        with precision:
            totals.append(ending_log_likelihoods(model, encode, example, seq_len, device, prefix, boundary))
    return {**choice_scores(examples, totals), "seconds": time.perf_counter() - start}


__all__ = ["Example", "read_choices", "document_start", "ending_text", "ending_rows", "ending_log_likelihoods",
           "choice_scores", "score_choices", "ChoiceSet", "choice_set"]
