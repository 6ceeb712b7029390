"""bench/with_mps.sh: a command's CUDA processes as clients of a private MPS server, the server
stopped afterwards, also when the script is stopped. Here with a stand-in for
nvidia-cuda-mps-control that records what it is asked (a real server needs a GPU)."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "with_mps.sh"


def _path_dir(tmp_path: Path, with_control: bool) -> str:
    """A PATH of the few tools the script and the tests' commands use (so that a real
    nvidia-cuda-mps-control on a GPU machine is not found), plus the stand-in when asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mktemp", "rm", "sleep", "cat", "bash", "touch"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if with_control:
        control = bin_dir / "nvidia-cuda-mps-control"
        control.write_text('#!/bin/bash\nif [ "${1:-}" = -d ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$MPS_LOG"\n'
                           'else read -r cmd; echo "$cmd" >> "$MPS_LOG"; fi\n')
        control.chmod(0o755)
    return str(bin_dir)


def _env(tmp_path: Path, with_control: bool) -> dict:
    return dict(os.environ, PATH=_path_dir(tmp_path, with_control), MPS_LOG=str(tmp_path / "mps.log"))


def test_runs_the_command_as_a_client_and_stops_the_server(tmp_path):
    seen = tmp_path / "seen"
    r = subprocess.run(["bash", str(SCRIPT), "bash", "-c", f'echo "$CUDA_MPS_PIPE_DIRECTORY" > {seen}; exit 7'],
                       env=_env(tmp_path, True), capture_output=True, text=True, timeout=30)
    assert r.returncode == 7, r.stderr  # the command's status
    pipe = seen.read_text().strip()
    assert (tmp_path / "mps.log").read_text().splitlines() == [f"start {pipe}", "quit"]
    assert pipe and not Path(pipe).exists()  # the private pipe directory is removed


def test_a_stopped_script_stops_its_command_then_the_server(tmp_path):
    marker = tmp_path / "command-ended"
    proc = subprocess.Popen(["bash", str(SCRIPT), "bash", "-c", f"trap 'touch {marker}; exit 1' TERM; "
                             "sleep 60 & wait"], env=_env(tmp_path, True),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "mps.log"
    deadline = time.monotonic() + 20
    while not (log.exists() and log.read_text().startswith("start")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the command is running
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 143
    assert marker.exists()  # the command got the signal and ended before the server was stopped
    assert log.read_text().splitlines()[-1] == "quit"


def test_without_mps_it_says_so_and_runs_nothing(tmp_path):
    ran = tmp_path / "ran"
    r = subprocess.run(["bash", str(SCRIPT), "bash", "-c", f"touch {ran}"], env=_env(tmp_path, False),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 3 and not ran.exists()
    assert r.stderr.strip() == ("with_mps.sh: nvidia-cuda-mps-control is not on PATH: CUDA MPS is not "
                                "available here")
