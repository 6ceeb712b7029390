"""Long studies, excluded from the default suite: ``pytest -m slow`` (about 5 minutes on 2 cores).

The delay study at its default size (small GPT, the built-in corpus, 100 steps, 3 seeds, sync vs
2bw per optimizer, EF β 0.25/0.5/1.0 on Muon) must show what the project claims: the one-step
delay costs AdamW more than Muon, and error feedback wins back part of Muon's gap. A real
2-stage run equals its simulation on the way (the study's spot check)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STUDY_PATH = Path(__file__).resolve().parents[2] / "bench" / "delay_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("delay_study", STUDY_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["delay_study"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_delay_costs_adamw_more_than_muon_and_ef_recovers_part_of_muons_gap(study, capsys):
    assert study.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    summary = out["summary"]
    print(study.format_table(summary, out["setup"]["seeds"]), file=sys.stderr)
    assert out["spot_check"]["status"] == "ok", out["spot_check"]
    gap = {label: row["gap"][0] for label, row in summary.items()}
    assert gap["adamw"] > gap["muon"] > 0, gap
    assert gap["muon+ef0.5"] < gap["muon"], gap
