"""asyncpp-schedule: JSON and table output, the timeline plot, one-line errors with exit 2, and
stops and unwritable output with one line."""
import json
import os
import signal
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
    (["--schedule", "1f1b", "--stages", "0", "--microbatches", "4"], "--stages/-S must be >= 1 (got 0)"),
    (["--schedule", "1f1b", "-S", "2", "-m", "0"], "--microbatches/-m must be >= 1 (got 0)"),
    (["--schedule", "2bw", "--stages", "4", "--microbatches", "2"],
     "raise --microbatches to at least 4"),
    (["--schedule", "pipedream", "--stages", "4", "--microbatches", "2", "--steps", "16", "--json"],
     "pipedream runs one microbatch per optimizer step (got m=2): use --microbatches 1"),
    (["--schedule", "zb", "--stages", "2", "--microbatches", "2"], "invalid choice: 'zb'"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--fwd", "-1"],
     "--fwd must be a finite cost >= 0"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--fwd", "nan"],
     "--fwd must be a finite cost >= 0"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--bwd", "inf"],
     "--bwd must be a finite cost >= 0"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--steps", "0"],
     "--steps/-K must be >= 1 (got 0)"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--plot", "/dev/null/t.png"],
     "--plot /dev/null/t.png: /dev/null is not a writable directory"),
    (["--stages", "2", "--microbatches", "2"], "the following arguments are required: --schedule"),
    (["--schedule", "gpipe", "-S", "3000000000", "-m", "1"], "--stages/-S 3000000000 is more than 2147483647"),
    (["--schedule", "gpipe", "-S", "3000000", "-m", "1"],
     "--stages x --microbatches x --steps = 3000000 x 1 x 1 is more than 2000000; lower any of the three"),
    (["--schedule", "1f1b", "-S", "2", "-m", "2", "--fwd", "1e308", "--bwd", "1e308", "--json"],
     "the costs overflow (makespan x stages = inf x 2"),
    (["--schedule", "1f1b", "-S", "2", "-m", "2", "--p2p", "1e308"], "use smaller --fwd/--bwd/--p2p/--opt"),
    # finite makespan, but the bubble fraction's stages x makespan is not
    (["--schedule", "1f1b", "-S", "2", "-m", "1", "--fwd", "0.8e308", "--bwd", "0"], "the costs overflow"),
    (["--schedule", "1f1b", "-S", "2", "-m", "2500", "--plot", "t.png"],
     "--plot would draw 10002 boxes, more than 10000"),
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


def test_plot_boxes_counts_the_timeline_before_simulating():
    from asyncpp_ext.schedule.plot import plot_boxes

    for name, m in (("gpipe", 3), ("1f1b", 3), ("2bw", 3), ("pipedream", 1)):
        res = sc.simulate(name, stages=3, microbatches=m, steps=2, opt=0.5)
        assert plot_boxes(3, m, 2) == len(res.timeline), name


@pytest.mark.parametrize("path,needle", [
    ("w", "--plot w is a directory; name a file such as w/timeline.png"),
    ("", "--plot '' names no file"),
    ("-", "--plot - has no suffix"),
    ("out/timeline", "--plot out/timeline has no suffix to choose the format by; name the file with "
                     "one, such as out/timeline.png"),
    ("t.xyz", "--plot t.xyz: matplotlib cannot write .xyz files; use one of "),
])
def test_plot_names_the_file_it_writes_or_is_refused(path, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w").mkdir()
    assert main(["--schedule", "1f1b", "-S", "2", "-m", "2", "--plot", path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and needle in err, err
    assert [p.name for p in tmp_path.rglob("*")] == ["w"]  # nothing written


def test_plot_makes_missing_directories_and_reports_the_file_written(tmp_path, capsys):
    path = tmp_path / "a" / "b" / "t.svg"
    assert main(["--schedule", "1f1b", "-S", "2", "-m", "2", "--json", "--plot", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(path)
    assert path.read_text().startswith("<?xml") and os.listdir(path.parent) == ["t.svg"]
    # the library keeps matplotlib's .png for a name without a suffix, and says so
    res = sc.simulate("1f1b", stages=2, microbatches=2)
    assert sc.plot_timeline(res, tmp_path / "t") == str(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC) and not (tmp_path / "t").exists()


# The stop lands while the plot is being saved: the picture is complete but not yet in place.
_STOP_WHILE_SAVING = """
import os, signal, sys, time
from matplotlib.figure import Figure
from asyncpp_ext.schedule.cli import main
save = Figure.savefig
def save_then_stop(self, *args, **kwargs):
    save(self, *args, **kwargs)
    os.kill(os.getpid(), int(sys.argv[1]))
    time.sleep(30)
Figure.savefig = save_then_stop
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("signum,line", [(signal.SIGINT, "asyncpp-schedule: interrupted"),
                                         (signal.SIGTERM, "asyncpp-schedule: stopped by SIGTERM")])
def test_a_stop_prints_one_line_exits_128_plus_the_signal_and_leaves_no_plot(signum, line, tmp_path):
    # SIGINT as a terminal delivers it: a background job (CI's, say) starts its children with it ignored
    proc = subprocess.run([sys.executable, "-c", _STOP_WHILE_SAVING, str(int(signum)), "--schedule",
                           "1f1b", "-S", "2", "-m", "2", "--plot", str(tmp_path / "new" / "t.png")],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (128 + signum, [line], "")
    assert list(tmp_path.iterdir()) == []  # neither the picture, a partial one, nor its directory


def test_a_closed_stdout_ends_quietly_and_a_full_one_says_so():
    argv = [sys.executable, "-m", "asyncpp_ext.schedule", "--schedule", "1f1b", "-S", "100", "-m", "100",
            "--json", "--timeline"]  # megabytes: more than a pipe holds
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(10) == b'{"schedule'
    proc.stdout.close()  # as `| head -c 10` does
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=120), err) == (128 + signal.SIGPIPE, "")
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(argv[:-1], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.splitlines()) == (
        1, ["asyncpp-schedule: error: could not write the output (No space left on device)"])
