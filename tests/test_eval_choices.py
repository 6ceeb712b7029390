"""``--eval-choices FILE``: multiple-choice tasks scored at every evaluation of a training run. Each
ending is a row of fixed (batch, seq_len) batches whose targets are the ending's tokens only, so
that the row's summed cross entropy is minus the ending's log-likelihood; the rows' ``choices``
equal asyncpp-eval --choices on the same weights; a pipeline's (and a data-parallel one's) equal
its simulation's."""
import json

import pytest
import torch

from asyncpp_ext.eval import main as evaluate
from asyncpp_ext.models.registry import MODEL_PRESETS, build_model
from asyncpp_ext.training.choice_eval import IGNORE, Example, choice_set, ending_log_likelihoods
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.simulate import default_row_losses
from asyncpp_ext.training.tensorboard_log import row_scalars


def encode(text):
    return list(text.encode("utf-8"))


EXAMPLES = [Example("The cat sat on the", ("mat.", "hat and then ran away", "x"), 0),
            Example("To be, or not to be:", (" that is", "\nthe question", "whether 'tis nobler"), 2),
            Example("a" * 40, ("b" * 10, "cc"), 1)]  # 40 + 10 bytes: cut to the model's 32 + 1


def test_a_rows_summed_loss_is_minus_its_endings_log_likelihood():
    model = build_model(MODEL_PRESETS["tiny"], seed=3).eval()
    task = choice_set(EXAMPLES, encode, 32, batch_size=3, prefix=[10])
    assert [tuple(x.shape) for x, _ in task.batches] == [(3, 32)] * 3  # 8 endings, one row of padding
    x, y = task.batches[-1]
    assert torch.all(y[2] == IGNORE)  # the padding row scores nothing
    with torch.no_grad():
        rows = [s for x, y in task.batches for s in default_row_losses(model, x, y).tolist()]
    assert rows[8] == 0.0
    want = [t for e in EXAMPLES for t in ending_log_likelihoods(model, encode, e, 32, torch.device("cpu"), [10])]
    assert [-r for r in rows[:8]] == pytest.approx(want, rel=1e-5)
    scores = task.score(rows)
    assert scores["right_loglik"] == pytest.approx((want[0] + want[5] + want[7]) / 3, rel=1e-5)
    assert scores["examples"] == 3


FLAGS = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--microbatches", "2", "--steps", "4",
         "--eval-every", "2", "--eval-batches", "2", "--no-progress", "--threads", "1"]


def _task(path, labels=None):
    lines = [{"context": e.context, "endings": list(e.endings), "label": e.label if labels is None else labels[i]}
             for i, e in enumerate(EXAMPLES * 2)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _choices(run):
    return [r.get("choices") for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("mask", [[], ["--document-mask", "10"]], ids=["whole-window", "document-mask"])
def test_the_rows_scores_are_asyncpp_evals_on_those_weights(tmp_path, mask):
    # Under --document-mask 10 (a newline starts a document) the second example's ending
    # "\nthe question", made the right one here so that right_loglik holds it, attends within its
    # own document, in the rows and in asyncpp-eval alike.
    task = _task(tmp_path / "quiz.jsonl", labels=[0, 1, 1] * 2)
    run = tmp_path / "run"
    assert train([*FLAGS, *mask, "--simulate", "--eval-choices", str(task), "--out", str(run)]) == 0
    rows = _choices(run)
    assert rows[0] is None and rows[2] is None and set(rows[1]) == set(rows[3]) == {"quiz"}
    assert evaluate([str(run), "--choices", str(task), "--json", str(tmp_path / "eval.json")]) == 0
    want, = json.loads((tmp_path / "eval.json").read_text())
    got = rows[3]["quiz"]
    assert got["examples"] == want["examples"] == 6
    assert (got["accuracy"], got["accuracy_norm"]) == (want["accuracy"], want["accuracy_norm"])
    assert got["right_loglik"] == pytest.approx(want["right_loglik"], rel=1e-5)
    assert rows[1]["quiz"]["right_loglik"] != got["right_loglik"]  # each evaluation scores its own weights


def test_accuracy_follows_the_labels(tmp_path):
    """Labels set to asyncpp-eval's most likely endings: accuracy 1; shifted by one: 0."""
    from asyncpp_ext.training.export import load_model

    run = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--out", str(run)]) == 0
    model = load_model(run / "ckpt-000004")[2]
    best = []
    for e in EXAMPLES * 2:
        sums = ending_log_likelihoods(model, encode, e, 32, torch.device("cpu"))
        best.append(max(range(len(sums)), key=sums.__getitem__))
    right = _task(tmp_path / "right.jsonl", best)
    wrong = _task(tmp_path / "wrong.jsonl", [(b + 1) % len(e.endings) for b, e in zip(best, EXAMPLES * 2)])
    again = tmp_path / "again"
    assert train([*FLAGS, "--simulate", "--eval-choices", str(right), "--eval-choices", str(wrong),
                  "--out", str(again)]) == 0
    last = _choices(again)[3]
    assert last["right"]["accuracy"] == 1.0 and last["wrong"]["accuracy"] == 0.0


def _scored(tmp_path, name, flags):
    task = _task(tmp_path / "quiz.jsonl")
    assert train([*FLAGS, *flags, "--eval-choices", str(task), "--eval-choices-limit", "5", "--no-checkpoints",
                  "--out", str(tmp_path / name)]) == 0
    return [r["quiz"] for r in _choices(tmp_path / name) if r is not None]


def test_a_pipeline_scores_as_its_simulation(tmp_path):
    sim = _scored(tmp_path, "sim", ["--simulate"])
    assert _scored(tmp_path, "real", ["--stages", "2", "--timeout", "60"]) == sim  # list equality
    assert len(sim) == 2 and sim[0]["examples"] == 5


def test_rows_as_long_as_the_longest_window_cross_the_stages(tmp_path):
    """At seq_len 128 the task's windows (<= 52 tokens) make rows of 64: the stages pass
    activations of that length, and the scores are still the simulation's and asyncpp-eval's."""
    long = ["--seq-len", "128", "--micro-batch-size", "1"]
    assert [tuple(x.shape) for x, _ in choice_set(EXAMPLES, encode, 128, batch_size=2).batches] == [(2, 64)] * 4
    sim = _scored(tmp_path, "sim", ["--simulate", *long])
    assert _scored(tmp_path, "real", ["--stages", "2", "--timeout", "60", *long]) == sim
    assert len(sim) == 2


def test_data_parallel_replicas_score_their_rows_together(tmp_path):
    """2 replicas of 2 rows against one process of 4: the same sequences, gradients summed in
    another order (equal to float rounding, as their losses are); every row scored once, in order."""
    sim = _scored(tmp_path, "sim", ["--simulate", "--micro-batch-size", "4"])
    real = _scored(tmp_path, "real", ["--dp", "2", "--timeout", "60"])
    for a, b in zip(real, sim):
        assert (a["examples"], a["accuracy"], a["accuracy_norm"]) == (b["examples"], b["accuracy"], b["accuracy_norm"])
        assert a["right_loglik"] == pytest.approx(b["right_loglik"], rel=1e-5)
    assert len(real) == 2


def test_the_figures_reach_tensorboard_and_the_log_line(tmp_path, capsys):
    row = {"step": 2, "choices": {"quiz": {"accuracy": 0.5, "accuracy_norm": 0.25, "right_loglik": None,
                                           "examples": 4}}}
    assert row_scalars(row) == {"eval/choices/quiz/accuracy": 0.5, "eval/choices/quiz/accuracy_norm": 0.25}
    task = _task(tmp_path / "quiz.jsonl")
    assert train([*FLAGS, "--simulate", "--no-checkpoints", "--log-every", "2", "--eval-choices", str(task),
                  "--out", str(tmp_path / "run")]) == 0
    assert "quiz accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    (None, "--eval-choices {}: no such file"),
    ('{"context": "a", "endings": ["b"], "label": 0}\n', "line 1: needs \"endings\", a list of at least 2"),
    ("", "holds no examples"),
])
def test_a_bad_task_is_one_line_before_anything_runs(tmp_path, capsys, content, message):
    task = tmp_path / "quiz.jsonl"
    if content is not None:
        task.write_text(content)
    out = tmp_path / "run"
    for layout in (["--simulate"], ["--stages", "2"]):
        assert train([*FLAGS, *layout, "--eval-choices", str(task), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message.format(task) in err[0], err
        assert not out.exists()


def test_a_resume_may_change_the_tasks(tmp_path):
    run = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--out", str(run)]) == 0
    task = _task(tmp_path / "quiz.jsonl")
    assert train([*FLAGS, "--simulate", "--steps", "6", "--eval-choices", str(task), "--resume", str(run)]) == 0
    assert _choices(run)[5]["quiz"]["examples"] == 6
