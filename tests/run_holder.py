"""A run directory held by another process, as a run in progress holds its --out."""
import contextlib
import subprocess
import sys


@contextlib.contextmanager
def run_dir_held(run):
    """Make run directory ``run`` in a process of its own, which holds it until the block ends;
    yields that process's pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from asyncpp_ext.training.run_files import prepare_run_dir; "
         f"prepare_run_dir({str(run)!r}, resuming=False); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
