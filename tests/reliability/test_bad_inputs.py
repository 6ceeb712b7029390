"""One table of bad inputs across CLI, config, environment, data, model partitioning and (single-
and multi-stage) checkpoints: each ends with exit code 2, exactly one line
``asyncpp-train: error: ...``, no traceback, and nothing half-written (no new run directory, no
temporary files, a refused resume leaves its run untouched)."""
import json
import os
import subprocess
import sys
import shutil

import pytest
import torch

from asyncpp_ext.training.cli import main

FAST = ["--simulate", "--no-progress", "--n-layer", "1", "--micro-batch-size", "4", "--microbatches", "2"]
PIPE = ["--no-progress", "--n-layer", "2", "--micro-batch-size", "2", "--seq-len", "16", "--stages", "2",
        "--microbatches", "2", "--eval-every", "0"]


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: OpenMP spinning only slows a loaded 2-core machine
    yield
    torch.set_num_threads(before)


def _finish(run, argv):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures set up before the autouse fixture
    try:
        assert main(argv + ["--steps", "3", "--out", str(run)]) == 0
    finally:
        torch.set_num_threads(before)
    return run


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    """A finished single-process run and a finished 2-stage pipeline run (checkpoint at step 3)."""
    base = tmp_path_factory.mktemp("base")
    return {"single": _finish(base / "single", FAST), "pipeline": _finish(base / "pipeline", PIPE)}


def _damage(run, kind):
    ckpt = run / "ckpt-000003"
    shard = ckpt / ("stage-01.pt" if "pipe" in kind else "stage-00.pt")
    if kind.startswith("corrupt"):
        data = bytearray(shard.read_bytes())
        data[100] ^= 0x55
        shard.write_bytes(bytes(data))
    elif kind.startswith("truncate"):
        shard.write_bytes(shard.read_bytes()[:50])
    elif kind == "nockpt":
        shutil.rmtree(ckpt)
    elif kind == "meta-garbage":
        (ckpt / "meta.json").write_text("{not json")
    elif kind == "meta-config":
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["config"]["train"]["bogus"] = 1
        (ckpt / "meta.json").write_text(json.dumps(meta))
    elif kind == "meta-step":
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["step"] = "two"
        (ckpt / "meta.json").write_text(json.dumps(meta))
    elif kind in ("meta-shard-entry", "meta-no-shards"):
        meta = json.loads((ckpt / "meta.json").read_text())
        if kind == "meta-no-shards":
            meta["shards"] = {}
        else:
            del meta["shards"]["stage-00.pt"]["bytes"]
        (ckpt / "meta.json").write_text(json.dumps(meta))
    elif kind == "pipe-missing-shard":
        shard.unlink()


RESUME_KINDS = {  # kind -> (which finished run, extra argv)
    "corrupt": ("single", []), "truncate": ("single", []), "nockpt": ("single", []),
    "mismatch": ("single", ["--n-layer", "2"]), "backwards": ("single", ["--steps", "2"]),
    "meta-garbage": ("single", []), "meta-config": ("single", []), "meta-step": ("single", []),
    "meta-shard-entry": ("single", []), "meta-no-shards": ("single", []),
    "corrupt-pipe": ("pipeline", []), "truncate-pipe": ("pipeline", []),
    "pipe-missing-shard": ("pipeline", []), "mismatch-pipe": ("pipeline", ["--n-embd", "64"]),
    "timeout-resume": ("pipeline", ["--timeout", "-1"]),
    "val-data-added": ("single", ["--val-data", __file__]),  # any UTF-8 text will do as held-out data
}


def _setup(tmp_path, finished_runs, kind, monkeypatch):
    """Returns (argv, run directory that must stay unchanged or None)."""
    out = str(tmp_path / "out")
    if kind in RESUME_KINDS:
        which, extra = RESUME_KINDS[kind]
        run = tmp_path / "resumed"
        shutil.copytree(finished_runs[which], run)
        _damage(run, kind)
        steps = [] if "--steps" in extra else ["--steps", "6"]
        return ["--resume", str(run)] + steps + extra, run
    files = {"missing": None, "empty": b"", "short": b"hello world\n" * 10, "latin1": b"caf\xe9\n" * 500,
             "oddbin": b"\x01\x02\x03"}
    if kind in files:
        path = tmp_path / ("data.bin" if kind == "oddbin" else "data.txt")
        if files[kind] is not None:
            path.write_bytes(files[kind])
        return FAST + ["--data", str(path), "--out", out], None
    if kind == "--out=":  # an empty run directory (it would be the current one)
        return FAST + ["--out="], None
    if kind == "unwritable":
        (tmp_path / "afile").write_text("x")
        return FAST + ["--out", str(tmp_path / "afile" / "run")], None
    if kind.startswith("env "):  # "env VALUE" sets ASYNCPP_TIMEOUT, "env NAME=VALUE[ KIND]" any variable
        setting, _, kind = kind[4:].partition(" ")
        name, _, value = setting.rpartition("=")
        monkeypatch.setenv(name or "ASYNCPP_TIMEOUT", value)
        if not kind:
            return FAST + ["--out", out], None
    if kind.startswith("gpus "):  # "gpus N[ nonccl] FLAGS": torch pretends to see N GPUs (and no NCCL library)
        _, count, rest = kind.split(" ", 2)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: int(count) > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: int(count))
        if rest.startswith("nonccl "):
            from asyncpp_ext.pipeline import nccl

            rest = rest[len("nonccl "):]
            monkeypatch.setattr(nccl.C, "build_config", lambda: {"cuda_compiled": True})
            monkeypatch.setattr(nccl.C, "nccl_load", lambda candidates: {"ok": False, "error": "libnccl.so.2: not found;"})
        kind = "pipe " + rest
    if kind.startswith("pipe "):  # a real (multi-process) run's flags
        return PIPE + kind[5:].split() + ["--out", out], None
    return FAST + kind.split() + ["--out", out], None


BAD_INPUTS = [
    # data
    ("missing", "does not exist"),
    ("empty", "is empty"),
    ("short", "has 120 tokens but one batch needs at least"),
    ("latin1", "is not UTF-8"),
    ("oddbin", "odd byte length"),
    ("--data=", "--data: data.source must name a file, directory, glob or manifest (or builtin), got ''"),
    ("--val-data=", "--val-data: data.val_source must name a file, directory, glob or manifest"),
    # run directory
    ("unwritable", "cannot write to --out"),
    # single-process checkpoints
    ("corrupt", "stage-00.pt is corrupted"),
    ("truncate", "stage-00.pt is truncated"),
    ("meta-step", "has step='two', not an integer; the checkpoint is damaged"),
    ("mismatch", "model.n_layer=1 but this run has 2"),
    ("val-data-added", "was written by a run without --val-data, which decides the training tokens (with it "
                       "all of --data trains, without it the end of --data is held out for evaluation); drop "
                       "--val-data"),
    ("nockpt", "no checkpoint"),
    ("backwards", "--steps 2 is before the checkpoint's step 3"),
    ("meta-garbage", "meta.json is unreadable or corrupted"),
    ("meta-config", "holds an unusable config (unknown field(s) train.bogus"),
    ("meta-shard-entry", "has shards={'stage-00.pt': {'sha256':"),
    ("meta-no-shards", "has shards={}, not a mapping of each shard to its bytes and sha256"),
    # 2-stage pipeline checkpoints (resumed as a multi-process run)
    ("corrupt-pipe", "stage-01.pt is corrupted"),
    ("truncate-pipe", "stage-01.pt is truncated"),
    ("pipe-missing-shard", "stage-01.pt is missing"),
    ("mismatch-pipe", "model.n_embd=32 but this run has 64"),
    ("timeout-resume", "--timeout: train.timeout_s must be a positive number, got -1.0"),
    # model partitioning and schedule (multi-process runs)
    ("--stages 4", "pipeline.stages=4 exceeds the model's 3 blocks"),
    ("pipe --stages 5", "pipeline.stages=5 exceeds the model's 4 blocks"),
    ("pipe --stages 3 --schedule 2bw", "2bw needs microbatches >= stages"),
    ("pipe --schedule sync", "--schedule sync is the one-process reference rule"),
    # devices and transports (multi-process runs; refused before any rank starts)
    # "gpus 0": no GPU visible, also on a machine that has one
    ("gpus 0 --device cuda", "--device: train.device=cuda but no CUDA GPU is visible; use --device cpu"),
    ("gpus 0 --device cuda --transport gloo", "--device: train.device=cuda but no CUDA GPU is visible"),
    ("pipe --transport nccl", "--transport: pipeline.transport='nccl' moves CUDA tensors but train.device='cpu'"),
    ("--transport nccl", "--transport: pipeline.transport='nccl' moves CUDA tensors but train.device='cpu'"),
    ("pipe --transport bogus", "argument --transport: invalid choice: 'bogus'"),
    ("gpus 1 --device cuda --transport nccl",
     "2 ranks on this machine but 1 GPU visible; transport 'nccl' needs one GPU per rank: lower --stages x --dp, "
     "or use --transport ipc (or gloo) to share GPUs"),
    ("gpus 2 --device cuda --transport torch --dp 2", "4 ranks on this machine but 2 GPUs visible; transport 'torch'"),
    ("gpus 1 --device cuda", "2 ranks on this machine but 1 GPU visible; transport 'nccl'"),
    ("gpus 2 nonccl --device cuda --transport nccl",
     "--transport nccl: NCCL could not be loaded (tried: libnccl.so.2: not found): pip install nvidia-nccl-cu12"),
    ("gpus 2 nonccl --device cuda", "(auto picks nccl on cuda; --transport gloo avoids it): NCCL could not be loaded"),
    ("--n-head 3", "model.n_head=3 must divide model.n_embd=32"),
    # config values
    ("--steps 0", "train.steps must be a positive integer"),
    ("--steps -5", "train.steps must be a positive integer"),
    ("--lr 0", "optim.lr must be a positive number"),
    ("--lr=-1e-3", "--lr: optim.lr must be a positive number"),
    ("--microbatches 0", "pipeline.microbatches must be a positive integer"),
    ("--weight-decay -1", "optim.weight_decay must be a non-negative number"),
    ("--timeout 0", "--timeout: train.timeout_s must be a positive number, got 0.0"),
    ("--timeout inf", "--timeout: train.timeout_s must be finite, got inf"),
    ("--timeout 1e-9", "--timeout: train.timeout_s must be at least 1 s"),
    ("pipe --timeout 1e10", "--timeout: train.timeout_s must be at most 1e+08 s (about 3 years"),
    ("--n-embd 2147483647 --n-head 1", "--n-embd: model.n_embd must be at most 65536, got 2147483647"),
    ("--delay 2147483647 --steps 2", "--delay: pipeline.delay=2147483647 is longer than the run"),
    ("--profile-steps 3:10 --steps 2", "--profile-steps: train.profile_steps=3:10 starts after the run's last step"),
    ("--val-data nope.bin", "--val-data nope.bin does not exist (or is not a file); pass an existing text/.bin file"),
    ("--lr inf", "--lr: optim.lr must be finite, got inf"),
    ("--weight-decay inf", "--weight-decay: optim.weight_decay must be finite, got inf"),
    ("--seed 99999999999999999999", "--seed: train.seed must be at most 9223372036854775807"),
    ("--microbatches 99999999999999999999", "--microbatches: pipeline.microbatches must be at most 2147483647"),
    ("--threads 5000", "--threads: train.threads must be at most 1024, got 5000"),
    ("--vocab-size 2000000000", "--vocab-size: model.vocab_size must be at most 16777216"),
    ("--n-layer 100000", "--n-layer: model.n_layer must be at most 4096"),
    ("--out=", "--out: train.out must name the run directory, got ''"),
    ("--eval-batches 99999999", "--eval-batches 99999999 needs"),
    # a flag the schedule would ignore
    ("--min-lr-ratio 0.2", "--min-lr-ratio is where cosine, wsd and linear decay to; the constant schedule never decays"),
    ("--optimizer adamw --ns-dtype bf16", "optim.ns_dtype='bf16' sets muon's Newton-Schulz dtype, but the "
                                          "optimizer is 'adamw'"),
    ("--ns-dtype fp64", "invalid choice: 'fp64'"),
    ("--threads 0", "--threads: train.threads must be a positive integer, got 0"),
    ("--threads -2", "--threads: train.threads must be a positive integer, got -2"),
    ("pipe --threads 0", "--threads: train.threads must be a positive integer, got 0"),
    ("env abc", "ASYNCPP_TIMEOUT='abc' is not a positive number of seconds"),
    ("env -3", "ASYNCPP_TIMEOUT='-3' is not a positive number of seconds"),
    ("env ASYNCPP_BF16_MATMUL=fast", "ASYNCPP_BF16_MATMUL='fast' is not one of auto, native, emulated"),
    ("env ASYNCPP_START_METHOD=fork pipe --stages 2",
     "ASYNCPP_START_METHOD='fork' is not one of auto, forkserver, spawn"),
    ("env ASYNCPP_RECV_SPIN_US=fast pipe --stages 2",
     "ASYNCPP_RECV_SPIN_US='fast': use auto or a whole number of microseconds from 0 to 1000000"),
    ("env ASYNCPP_INLINE_RECV_BYTES=abc pipe --stages 2", "ASYNCPP_INLINE_RECV_BYTES='abc': use a whole number of bytes"),
    ("env ASYNCPP_IPC_SLOTS=99999999999 pipe --stages 2",
     "ASYNCPP_IPC_SLOTS='99999999999' is not an integer from 1 to 64"),
    ("env MASTER_ADDR=bad.invalid pipe --stages 2",
     "MASTER_ADDR='bad.invalid' is not an address of this machine (Name or service not known)"),
    ("env MASTER_ADDR=192.0.2.1 pipe --stages 2",  # a documentation address: never this machine's
     "MASTER_ADDR='192.0.2.1' is not an address of this machine (Cannot assign requested address)"),
    ("env ASYNCPP_SOCKET_HOST=bad.invalid pipe --stages 2",
     "ASYNCPP_SOCKET_HOST='bad.invalid' is not an IPv4 address or resolvable host name of this machine"),
    # command line
    ("--steps ten", "invalid int value: 'ten'"),
    ("--schedule async", "invalid choice: 'async'"),
    ("--on-nonfinite ignore", "invalid choice: 'ignore'"),
    ("--timeout soon", "invalid float value: 'soon'"),
    ("--threads two", "invalid int value: 'two'"),
    ("--bogus-flag", "unrecognized arguments: --bogus-flag"),
]


def _snapshot(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind, message", BAD_INPUTS, ids=[k for k, _ in BAD_INPUTS])
def test_bad_input_is_one_clean_error_line(tmp_path, finished_runs, capsys, monkeypatch, kind, message):
    argv, kept_run = _setup(tmp_path, finished_runs, kind, monkeypatch)
    before = _snapshot(kept_run) if kept_run else None
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("asyncpp-train: error: ") and message in lines[0], lines[0]
    assert ".cpp:" not in lines[0], lines[0]  # the core's source location is for debugging
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out").exists()
    if kept_run:
        assert _snapshot(kept_run) == before  # a refused resume changes nothing
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp" in p.name or p.name.startswith(".old-")]
    assert not leftovers, leftovers  # nothing half-written anywhere


@pytest.mark.parametrize("layout", [FAST, PIPE + ["--schedule", "2bw"]], ids=["simulated", "two-processes"])
def test_unknown_cpu_isa_is_one_clean_error_line(tmp_path, layout):
    """$ASYNCPP_CPU_ISA is read once per process, at the first kernel call, so only a fresh process
    shows what a user's run does: refused before any rank starts or anything is written."""
    env = dict(os.environ, ASYNCPP_CPU_ISA="sse9")
    r = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", *layout, "--out", str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncpp-train: error: ASYNCPP_CPU_ISA=sse9: not a known ISA; "
                                                   "use one of auto, baseline"), r.stderr
    assert not (tmp_path / "out").exists()


def test_a_model_too_large_for_memory_is_one_line(tmp_path, capsys):
    # a run failure (exit 1), not a traceback: a 16M x 65536 embedding (4 TiB) fits no machine
    assert main(FAST + ["--vocab-size", "16777216", "--n-embd", "65536", "--n-head", "1",
                        "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("asyncpp-train: error: out of memory ("), err
    assert "use a smaller model" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
