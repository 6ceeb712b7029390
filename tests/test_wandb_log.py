"""``--wandb``: the metrics rows go to a W&B run named after the run directory, at their steps; a
resumed run continues the same W&B run without logging a step twice; a run that cannot log
(no package, no credentials, W&B failing to start) is one line, exit 2."""
import json
import sys
import types

import pytest

from asyncpp_ext.training.cli import main as train

FLAGS = ["--model", "tiny", "--seq-len", "16", "--no-progress", "--eval-every", "2", "--ckpt-every", "2",
         "--clip-grad-norm", "1.0", "--threads", "1"]


class FakeRun:
    def __init__(self, step):
        self.step, self.logged, self.finished = step, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording its runs; ``fake.resumed_at`` is the step a W&B run
    reports when it is (re)started."""
    fake = types.SimpleNamespace(runs=[], inits=[], resumed_at=0)

    def init(**kwargs):
        fake.inits.append(kwargs)
        fake.runs.append(FakeRun(fake.resumed_at))
        return fake.runs[-1]

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return fake


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_rows_go_to_a_wandb_run_that_a_resume_continues(tmp_path, fake_wandb):
    run = tmp_path / "exp1"
    assert train([*FLAGS, "--simulate", "--steps", "4", "--wandb", "--out", str(run)]) == 0
    init = fake_wandb.inits[0]
    wandb_id = (run / "wandb_id").read_text().strip()
    assert (init["project"], init["name"], init["id"], init["resume"]) == ("asyncpp", "exp1", wandb_id, "allow")
    assert init["dir"] == str(run) and init["config"]["train"]["steps"] == 4
    logged = fake_wandb.runs[0].logged
    rows = _rows(run)
    assert [s for s, _ in logged] == [1, 2, 3, 4] and fake_wandb.runs[0].finished
    for (step, values), row in zip(logged, rows):
        assert values["train/loss"] == row["loss"] and values["train/grad_norm"] == row["grad_norm"]
        assert values["train/tokens"] == row["tokens"] and ("eval/loss" in values) == (step % 2 == 0)
    # the first attempt died after step 4 before its checkpoint there, W&B had reached step 5: resumed
    # from ckpt-2 to step 6, the run logs steps 5 and 6 only, into the same W&B run
    import shutil

    shutil.rmtree(run / "ckpt-000004")
    fake_wandb.resumed_at = 5
    assert train(["--resume", str(run), "--steps", "6", "--wandb-project", "other"]) == 0
    init = fake_wandb.inits[1]
    assert (init["project"], init["id"]) == ("other", wandb_id)
    assert [s for s, _ in fake_wandb.runs[1].logged] == [5, 6]


def test_an_offline_resume_logs_no_step_twice(tmp_path, fake_wandb):
    # offline, a restarted W&B run says step 0: the directory's record (OUT/wandb_step) says how
    # far the run logged, for a resume and for a rewind alike
    run = tmp_path / "exp1"
    assert train([*FLAGS, "--simulate", "--steps", "4", "--wandb", "--out", str(run)]) == 0
    assert (run / "wandb_step").read_text() == "5\n"
    assert fake_wandb.resumed_at == 0 and train(["--resume", str(run), "--rewind", "2", "--steps", "6"]) == 0
    assert [s for s, _ in fake_wandb.runs[1].logged] == [5, 6]
    assert (run / "wandb_step").read_text() == "7\n"


def test_an_offline_pipeline_run_logs_under_its_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the wandb package (pip install 'asyncpp_ext[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert train([*FLAGS, "--stages", "2", "--timeout", "60", "--steps", "4", "--wandb", "--out", str(run)]) == 0
    wandb_id = (run / "wandb_id").read_text().strip()
    logs = list((run / "wandb").glob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb"))
    assert len(logs) == 1 and logs[0].stat().st_size > 0


def test_without_the_package_it_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    assert train([*FLAGS, "--simulate", "--steps", "2", "--wandb", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'asyncpp_ext[wandb]'" in err, err
    assert not (tmp_path / "r").exists()


def test_online_without_credentials_is_one_line(tmp_path, monkeypatch, capsys, fake_wandb):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert train([*FLAGS, "--simulate", "--steps", "2", "--wandb", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run `wandb login`" in err and "WANDB_MODE=offline" in err, err
    assert not (tmp_path / "r").exists() and not fake_wandb.inits


def test_wandb_failing_to_start_is_one_line(tmp_path, capsys, fake_wandb):
    def refuse(**kwargs):
        raise RuntimeError("could not reach api.wandb.ai\nretrying")

    fake_wandb.init = refuse
    assert train([*FLAGS, "--simulate", "--steps", "2", "--wandb", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "W&B could not start the run (could not reach api.wandb.ai retrying)" in err, err
