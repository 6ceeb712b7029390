"""asyncpp-schedule: JSON and table output, the timeline plot, and one-line errors with exit 2."""
import json
import os
import subprocess
import sys

import pytest

from asyncpp_ext import schedule as sc
from asyncpp_ext.schedule.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_json_reports_the_simulation(capsys):
    rc = main(["--schedule", "2bw", "--stages", "4", "--microbatches", "8", "--steps", "10",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    d = json.loads(out)  # exactly one JSON object
    assert d["schedule"] == "2bw" and (d["stages"], d["microbatches"], d["steps"]) == (4, 8, 10)
    assert d["bubble_fraction"] == pytest.approx(3 / 83, abs=1e-12)
    assert d["makespan"] == pytest.approx(83 * 3.0)
    assert d["peak_inflight"] == [4, 3, 2, 1] and d["max_versions"] == [2, 2, 2, 2]
    assert d["busy"] == [240.0] * 4 and d["idle"] == [9.0] * 4
    assert "timeline" not in d


def test_json_reports_pipedream_versions_per_stage_and_its_bubble(capsys):
    rc = main(["--schedule", "pipedream", "--stages", "4", "--microbatches", "1", "--steps", "16",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    d = json.loads(out)
    assert d["schedule"] == "pipedream" and (d["stages"], d["microbatches"], d["steps"]) == (4, 1, 16)
    assert d["max_versions"] == [4, 3, 2, 1] and d["peak_inflight"] == [4, 3, 2, 1]
    assert d["bubble_fraction"] == pytest.approx(3 / 19, abs=1e-12)  # (S-1)/(K+S-1)
    assert d["makespan"] == pytest.approx(19 * 3.0) and d["busy"] == [48.0] * 4


def test_cli_choices_are_the_engine_schedules():
    from asyncpp_ext.schedule.cli import SCHEDULE_CHOICES

    assert SCHEDULE_CHOICES == sc.SCHEDULES and "pipedream" in SCHEDULE_CHOICES


def test_json_costs_and_timeline_flag(capsys):
    assert main(["--schedule", "gpipe", "-S", "2", "-m", "2", "--fwd", "1", "--bwd", "3",
                 "--p2p", "0.5", "--opt", "0.25", "--json", "--timeline"]) == 0
    d = json.loads(capsys.readouterr().out)
    expected = sc.simulate("gpipe", stages=2, microbatches=2, fwd=1, bwd=3, p2p=0.5, opt=0.25)
    assert d["makespan"] == expected.makespan and d["bwd"] == [3.0, 3.0] and d["opt"] == [0.25] * 2
    assert len(d["timeline"]) == len(expected.timeline)


def test_table_lists_every_stage_and_the_bubble(capsys):
    assert main(["--schedule", "1f1b", "--stages", "3", "--microbatches", "5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "peak in-flight" in lines[1] and "max versions" in lines[1]
    rows = [ln.split() for ln in lines[3:6]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert [int(r[3]) for r in rows] == [3, 2, 1]  # peak in-flight S - s
    assert f"bubble fraction {2 / 7:.6f}" in out and "makespan 21" in out


def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "timeline.png"
    assert main(["--schedule", "2bw", "-S", "4", "-m", "8", "-K", "3", "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    assert str(path) in capsys.readouterr().out


def test_plot_labels_every_box_with_microbatch_and_version(tmp_path):
    import matplotlib

    res = sc.simulate("1f1b", stages=2, microbatches=3, steps=2, opt=0.5)
    svg = tmp_path / "t.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # keep text as text in the SVG
        assert sc.plot_timeline(res, svg) == str(svg)
    text = svg.read_text()
    assert res.bubble_fraction == pytest.approx(1 - 38 / 50)  # busy 2*(9+0.5) of makespan 25
    for label in ("0|v0", "2|v0", "0|v1", "2|v1", ">v1<", ">v2<", "bubble fraction 0.240",
                  "stage 0", "stage 1", "optimizer step"):
        assert label in text, label


def test_pipedream_plot_labels_boxes_by_step_and_stashed_version(tmp_path):
    import matplotlib

    res = sc.simulate("pipedream", stages=4, microbatches=1, steps=8)
    svg = tmp_path / "pd.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        sc.plot_timeline(res, svg)
    text = svg.read_text()
    # Stage 0 runs step 4's forward on the newest version 1 and step 1's backward on stashed v0;
    # the last stage runs step 7 on v7.
    for label in (">4|v1<", ">1|v0<", ">7|v4<", ">7|v7<", ">v8<", "step|weight version",
                  "pipedream", "stage 3"):
        assert label in text, label


@pytest.mark.parametrize("argv,needle", [
    (["--schedule", "1f1b", "--stages", "0", "--microbatches", "4"], "stages must be >= 1"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "0"], "microbatches must be >= 1"),
    (["--schedule", "2bw", "--stages", "4", "--microbatches", "2"],
     "raise --microbatches to at least 4"),
    (["--schedule", "pipedream", "--stages", "4", "--microbatches", "2", "--steps", "16", "--json"],
     "pipedream runs one microbatch per optimizer step (got m=2): use --microbatches 1"),
    (["--schedule", "zb", "--stages", "2", "--microbatches", "2"], "invalid choice: 'zb'"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--fwd", "-1"],
     "--fwd must be a finite cost >= 0"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--steps", "0"],
     "steps must be >= 1"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--plot",
      "/nonexistent-dir/t.png"], "cannot write plot to '/nonexistent-dir/t.png'"),
    (["--stages", "2", "--microbatches", "2"], "the following arguments are required: --schedule"),
    (["--schedule", "gpipe", "-S", "3000000000", "-m", "1"], "--stages 3000000000 is more than 2147483647"),
    (["--schedule", "gpipe", "-S", "2", "-m", "2", "--timeline"], "--timeline adds the timeline to the JSON"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("asyncpp-schedule: error: "), err
    assert needle in err and "Traceback" not in err and "[" not in err.split(": error: ")[1][:1]
    assert ".cpp:" not in err  # the core's source location is for debugging, not for the user


def test_module_and_console_script_run_as_processes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncpp_ext.schedule", "--schedule", "2bw",
                           "--stages", "2", "--microbatches", "1"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "asyncpp-schedule: error: 2bw needs microbatches >= stages (got m=1, S=2): "
        "raise --microbatches to at least 2"]
    script = os.path.join(os.path.dirname(sys.executable), "asyncpp-schedule")
    if not os.path.exists(script):
        pytest.skip("console script not installed next to this interpreter")
    proc = subprocess.run([script, "--schedule", "gpipe", "--stages", "3", "--microbatches", "4",
                           "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["peak_inflight"] == [4, 4, 4]
