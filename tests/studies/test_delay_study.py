"""Long studies, excluded from the default suite: ``pytest -m slow`` (about 8 minutes on 2 cores).

The delay study at its default size (small GPT, the built-in corpus, 100 steps, 3 seeds, sync vs
2bw per optimizer, EF β 0.25/0.5/1.0 on Muon) must show what the project claims: the one-step
delay costs AdamW more than Muon, and error feedback wins back part of Muon's gap. A real
2-stage run equals its simulation on the way (the study's spot check)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STUDY = Path(__file__).resolve().parents[2] / "bench" / "delay_study.py"


def test_delay_costs_adamw_more_than_muon_and_ef_recovers_part_of_muons_gap():
    # As a user runs it: its own process, whose worker pool re-imports the script by path.
    r = subprocess.run([sys.executable, str(STUDY), "--json"], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    summary = out["summary"]
    print(json.dumps({label: row["gap"] for label, row in summary.items()}), file=sys.stderr)
    assert out["spot_check"]["status"] == "ok", out["spot_check"]
    gap = {label: row["gap"][0] for label, row in summary.items()}
    assert gap["adamw"] > gap["muon"] > 0, gap
    assert gap["muon+ef0.5"] < gap["muon"], gap
