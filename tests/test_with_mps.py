"""bench/with_mps.sh: a command's CUDA processes as clients of a private MPS server, the server
stopped afterwards, also when the script is stopped. Here with a stand-in for
nvidia-cuda-mps-control that records what it is asked (a real server needs a GPU)."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "with_mps.sh"


def _path_dir(tmp_path: Path, with_control: bool) -> str:
    """A PATH of the few tools the script and the tests' commands use (so that a real
    nvidia-cuda-mps-control on a GPU machine is not found), plus the stand-in when asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mktemp", "rm", "sleep", "cat", "bash", "touch", "seq"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if with_control:
        control = bin_dir / "nvidia-cuda-mps-control"
        control.write_text('#!/bin/bash\nif [ "${1:-}" = -d ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$MPS_LOG"; exit 0; fi\n'
                           'read -r cmd; echo "$cmd" >> "$MPS_LOG"\n'
                           'if [ "$cmd" = get_server_list ]; then echo "${MPS_SERVERS-4242}"; fi\n')
        control.chmod(0o755)
    return str(bin_dir)


def _env(tmp_path: Path, with_control: bool, **extra) -> dict:
    return dict(os.environ, PATH=_path_dir(tmp_path, with_control), MPS_LOG=str(tmp_path / "mps.log"), **extra)


def test_runs_the_command_as_a_client_and_stops_the_server(tmp_path):
    seen = tmp_path / "seen"
    r = subprocess.run(["bash", str(SCRIPT), "bash", "-c", f'echo "$CUDA_MPS_PIPE_DIRECTORY" > {seen}; exit 7'],
                       env=_env(tmp_path, True), capture_output=True, text=True, timeout=30)
    assert r.returncode == 7, r.stderr  # the command's status
    pipe = seen.read_text().strip()
    assert (tmp_path / "mps.log").read_text().splitlines() == [f"start {pipe}", "get_server_list", "quit"]
    assert pipe and not Path(pipe).exists()  # the private pipe directory is removed
    assert "MPS server(s) 4242 served the command" in r.stderr


def _default_sigint():
    """SIGINT as a terminal delivers it: a pytest-xdist worker ignores it, and bash cannot trap a
    signal that was ignored when it started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_signal(tmp_path, command: str, sig) -> tuple[subprocess.Popen, float]:
    proc = subprocess.Popen(["bash", str(SCRIPT), "bash", "-c", command], env=_env(tmp_path, True),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    log = tmp_path / "mps.log"
    deadline = time.monotonic() + 20
    while not (log.exists() and log.read_text().startswith("start")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the command is running
    sent = time.monotonic()
    proc.send_signal(sig)
    return proc, sent


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_script_stops_its_command_then_the_daemon(tmp_path, sig, status):
    marker = tmp_path / "command-ended"
    proc, _ = _start_and_signal(tmp_path, f"trap 'touch {marker}; exit 1' TERM; sleep 60 & wait", sig)
    assert proc.wait(timeout=20) == status
    assert marker.exists()  # the command got the signal and ended before the daemon was stopped
    assert (tmp_path / "mps.log").read_text().splitlines()[-1] == "quit"


def test_a_command_deaf_to_sigterm_is_killed_after_3_s_and_the_daemon_still_stopped(tmp_path):
    proc, sent = _start_and_signal(tmp_path, "trap '' TERM; exec sleep 60", signal.SIGTERM)
    assert proc.wait(timeout=20) == 143
    assert 2.5 < time.monotonic() - sent < 10
    assert (tmp_path / "mps.log").read_text().splitlines()[-1] == "quit"


@pytest.mark.parametrize("command_status, status, servers", [(0, 4, ""), (5, 5, ""), (0, 4, "error: no reply")])
def test_no_mps_server_is_said_and_a_success_becomes_4(tmp_path, command_status, status, servers):
    r = subprocess.run(["bash", str(SCRIPT), "bash", "-c", f"exit {command_status}"],
                       env=_env(tmp_path, True, MPS_SERVERS=servers), capture_output=True, text=True, timeout=30)
    assert r.returncode == status
    assert "no MPS server ran: the command's processes did not run under MPS" in r.stderr


def test_without_mps_it_says_so_and_runs_nothing(tmp_path):
    ran = tmp_path / "ran"
    r = subprocess.run(["bash", str(SCRIPT), "bash", "-c", f"touch {ran}"], env=_env(tmp_path, False),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 3 and not ran.exists()
    assert r.stderr.strip() == ("with_mps.sh: nvidia-cuda-mps-control is not on PATH: CUDA MPS is not "
                                "available here")
