"""``asyncpp-eval --choices FILE``: multiple-choice accuracy. Each ending's log-likelihood equals a
token-by-token reference (one forward per prefix, no batching, no padding), cut windows included;
accuracy and accuracy_norm follow from those; bad task files and flags are one line."""
import json

import pytest
import torch
import torch.nn.functional as F

from asyncpp_ext.eval import main as evaluate
from asyncpp_ext.models.generate import last_logits
from asyncpp_ext.models.registry import MODEL_PRESETS, build_model
from asyncpp_ext.training.choice_eval import Example, ending_log_likelihoods, ending_text, score_choices
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.export import load_model


def encode(text):
    return list(text.encode("utf-8"))


@torch.no_grad()
def _reference(model, example, seq_len, start=()):
    """sum of log p(token | every token before it in the window), one prefix at a time."""
    totals = []
    for ending in example.endings:
        tail = encode(ending_text(example.context, ending))
        ids = (list(start) + encode(example.context) + tail)[-(seq_len + 1):]
        total = 0.0
        for k in range(max(1, len(ids) - len(tail)), len(ids)):
            logp = F.log_softmax(last_logits(model, torch.tensor([ids[:k]])), dim=-1)
            total += float(logp[0, ids[k]])
        totals.append(total)
    return totals


EXAMPLES = [Example("The cat sat on the", ("mat.", "hat and then ran away", "x"), 0),
            Example("To be, or not to be:", (" that is", "\nthe question", "whether 'tis nobler"), 2),
            Example("a" * 40, ("b" * 10, "cc"), 1)]  # 40 + 10 bytes: cut to the model's 32 + 1


@pytest.mark.parametrize("example", EXAMPLES, ids=["plain", "whitespace", "cut-window"])
def test_each_endings_log_likelihood_is_the_token_by_token_one(example):
    model = build_model(MODEL_PRESETS["tiny"], seed=3).eval()
    got = ending_log_likelihoods(model, encode, example, 32, torch.device("cpu"))
    want = _reference(model, example, 32)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert len(set(round(g, 6) for g in got)) == len(got)


def test_a_document_start_goes_before_the_context():
    model = build_model(MODEL_PRESETS["tiny"], seed=3).eval()
    example = Example("Once", ("upon a time", "x"), 0)
    got = ending_log_likelihoods(model, encode, example, 32, torch.device("cpu"), prefix=[10])
    assert got == pytest.approx(_reference(model, example, 32, start=[10]), rel=1e-5, abs=1e-4)
    assert got != pytest.approx(_reference(model, example, 32), rel=1e-5, abs=1e-4)


def test_accuracy_counts_the_most_likely_ending_and_norm_the_most_likely_per_byte():
    model = build_model(MODEL_PRESETS["tiny"], seed=3).eval()
    best, best_norm = [], []
    for e in EXAMPLES:
        totals = _reference(model, e, 32)
        per_byte = [t / len(ending_text(e.context, x).encode()) for t, x in zip(totals, e.endings)]
        best.append(max(range(len(totals)), key=totals.__getitem__))
        best_norm.append(max(range(len(totals)), key=per_byte.__getitem__))
    cpu, plain = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    labelled = [Example(e.context, e.endings, b) for e, b in zip(EXAMPLES, best)]
    result = score_choices(model, encode, labelled, 32, cpu, plain)
    assert result["accuracy"] == 1.0 and result["examples"] == 3
    assert result["accuracy_norm"] == sum(b == n for b, n in zip(best, best_norm)) / 3
    wrong = [Example(e.context, e.endings, (b + 1) % len(e.endings)) for e, b in zip(EXAMPLES, best)]
    assert score_choices(model, encode, wrong, 32, cpu, plain)["accuracy"] == 0.0


def test_the_ending_follows_the_context_as_written():
    assert ending_text("The cat", "sat") == " sat"
    assert ending_text("The cat ", "sat") == "sat" and ending_text("The cat", " sat") == " sat"
    assert ending_text("Q:\n", "A") == "A"


# ---- the command -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("choices") / "run"
    assert train(["--model", "tiny", "--steps", "2", "--no-progress", "--threads", "1", "--out", str(out),
                  "--eval-every", "0"]) == 0
    return out


def _task(tmp_path, lines, name="task.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


HELLASWAG_LIKE = [{"ind": 4, "ctx": "The cat sat on the", "endings": ["mat.", "hat", "x", "dog"], "label": "0"},
                  {"context": "To be, or not to be:", "endings": [" that is", "whether"], "label": 1},
                  {"ctx": "Once upon", "endings": ["a time", "zz"], "label": 0}]


def test_the_command_scores_each_checkpoint_and_file(run, tmp_path, capsys):
    task = _task(tmp_path, HELLASWAG_LIKE)
    out = tmp_path / "rows.json"
    assert evaluate([str(run), "--choices", task, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["task"] == task and row["examples"] == 3 and row["step"] == 2 and row["dtype"] == "fp32"
    from asyncpp_ext.training.choice_eval import read_choices
    model = load_model(run / "ckpt-000002")[2]
    want = score_choices(model, encode, read_choices(task), 32, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    assert (row["accuracy"], row["accuracy_norm"]) == (want["accuracy"], want["accuracy_norm"])
    assert evaluate([str(run), "--choices", task, "--limit", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["examples"] == 2
    assert "acc_norm" in capsys.readouterr().out


@pytest.mark.parametrize("lines, flags, words", [
    (None, ["--choices", "{tmp}/none.jsonl"], "none.jsonl: no such file"),
    (["{not json"], [], "task.jsonl, line 1: not JSON"),
    ([HELLASWAG_LIKE[0], {"ctx": "a", "endings": ["b", "c"], "label": 2}], [], "line 2: \"label\" must be the index"),
    ([{"ctx": "a", "endings": ["b"], "label": 0}], [], "at least 2 non-empty strings"),
    ([{"ctx": "", "endings": ["b", "c"], "label": 0}], [], "non-empty \"context\""),
    ([], [], "holds no examples"),
    (HELLASWAG_LIKE, ["--batches", "2"], "--batches sets the windows of the loss"),
    (HELLASWAG_LIKE, ["--limit", "0"], "--limit must be at least 1"),
])
def test_bad_tasks_and_flags_are_one_line(run, tmp_path, capsys, lines, flags, words):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    task = ["--choices", _task(tmp_path, lines)] if lines is not None else []
    out = tmp_path / "rows.json"
    assert evaluate([str(run), *task, *flags, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_limit_without_choices_is_one_line(run, capsys):
    assert evaluate([str(run), "--limit", "3"]) == 2
    assert "--limit applies to --choices only" in capsys.readouterr().err


def test_a_run_on_a_tokenizer_scores_after_its_end_of_text_token(tmp_path):
    pytest.importorskip("tokenizers", reason="a BPE run needs the tokenizers package")
    from bpe_tokenizer import bpe_llama_run

    tok = bpe_llama_run(tmp_path, 40_000, 300, model_vocab=320)
    task = _task(tmp_path, HELLASWAG_LIKE)
    assert evaluate([str(tmp_path / "run"), "--choices", task, "--json", str(tmp_path / "rows.json")]) == 0
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    from asyncpp_ext.training.choice_eval import read_choices
    cfg, _, model = load_model(tmp_path / "run" / "ckpt-000002")
    bpe = lambda text: tok.encode(text).ids  # noqa: E731
    eos = [tok.token_to_id("<|endoftext|>")]
    cpu, plain = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    examples = read_choices(task)
    want = score_choices(model, bpe, examples, cfg.model.seq_len, cpu, plain, prefix=eos)
    assert (row["accuracy"], row["accuracy_norm"]) == (want["accuracy"], want["accuracy_norm"])
    from asyncpp_ext.data.encode import ByteTokenizer
    from asyncpp_ext.training.choice_eval import document_start
    from asyncpp_ext.training.export import run_tokenizer
    assert document_start(run_tokenizer("auto", cfg, 320)) == eos and document_start(ByteTokenizer()) == []
    first = examples[0]
    with_start = ending_log_likelihoods(model, bpe, first, cfg.model.seq_len, cpu, prefix=eos)
    assert with_start != ending_log_likelihoods(model, bpe, first, cfg.model.seq_len, cpu)


@pytest.mark.cuda
def test_on_cuda_the_sums_are_the_cpus_and_auto_is_bf16(run, tmp_path):
    """fp32 on the GPU against the CPU (rel 1e-4), bf16 autocast within 2 % (tolerances set without
    a GPU run: a failure there means measuring the difference, not widening it)."""
    model = load_model(run / "ckpt-000002")[2]
    cpu = [ending_log_likelihoods(model, encode, e, 32, torch.device("cpu")) for e in EXAMPLES]
    model = model.cuda()
    gpu = [ending_log_likelihoods(model, encode, e, 32, torch.device("cuda")) for e in EXAMPLES]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = [ending_log_likelihoods(model, encode, e, 32, torch.device("cuda")) for e in EXAMPLES]
    for c, g, b in zip(cpu, gpu, bf16):
        assert g == pytest.approx(c, rel=1e-4) and b == pytest.approx(c, rel=2e-2)
    task = _task(tmp_path, HELLASWAG_LIKE)
    assert evaluate([str(run), "--choices", task, "--device", "cuda", "--json", str(tmp_path / "g.json")]) == 0
    (row,) = json.loads((tmp_path / "g.json").read_text())
    assert (row["device"], row["dtype"], row["examples"]) == ("cuda", "bf16", 3)
