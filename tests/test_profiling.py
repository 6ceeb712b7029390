"""--profile-steps: the window parser, the trace summary's arithmetic, and the files a CPU run writes."""
import gzip
import json

import pytest

from asyncpp_ext.training.cli import main
from asyncpp_ext.training.profiling import ProfileSpecError, kernel_kind, parse_profile_steps, summarize_trace


def test_parse_profile_steps():
    assert parse_profile_steps("6:8") == (6, 8)
    assert parse_profile_steps(" 3 ") == (3, 3)
    for bad in ("0:2", "5:4", "a:b", "3:", ""):
        with pytest.raises(ProfileSpecError):
            parse_profile_steps(bad)


def _x(cat, name, ts, dur, **kw):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **kw}


def test_summary_counts_overlapping_device_work_once():
    events = [
        _x("cpu_op", "aten::mm", 0, 100),
        _x("cuda_runtime", "cudaStreamSynchronize", 90, 5),
        _x("cpu_op", "aten::_local_scalar_dense", 95, 5),
        _x("kernel", "nvjet_sm90_tst_128x128", 10, 30),          # matmul
        _x("kernel", "triton_poi_fused_add_0", 30, 20),          # overlaps the matmul by 10
        _x("kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 60, 10),
        _x("gpu_memcpy", "Memcpy DtoH", 190, 10),                 # ends the window at 200
    ]
    s = summarize_trace(events)
    assert s["window_ms"] == pytest.approx(0.2)
    assert s["device_busy_ms"] == pytest.approx((50 - 10 + 10 + 10) / 1e3)  # [10,50) + [60,70) + [190,200)
    assert s["device_busy_share"] == pytest.approx(60 / 200)
    assert s["device_ms_by_kind"] == {"matmul": 0.03, "triton": 0.02, "attention": 0.01, "copy": 0.01}
    assert (s["kernels"], s["host_syncs"], s["item_calls"]) == (3, 1, 1)
    assert [(k["name"], k["kind"], k["ms"], k["launches"]) for k in s["top_kernels"]] == [
        ("nvjet_sm90_tst_128x128", "matmul", 0.03, 1), ("triton_poi_fused_add_0", "triton", 0.02, 1),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention", 0.01, 1)]
    # idle: 10 us before the first kernel; gaps of 10 us (50-60) and 120 us (70-190) between; the
    # window (0-200) = busy 60 + edges 10 + between 130; each gap's host: the op overlapping it most
    assert (s["idle_edges_ms"], s["idle_between_ms"]) == (0.01, 0.13)
    # (host_ops: every host op overlapping the gap, the most overlap first, then the outermost)
    assert s["idle_gaps"] == [
        {"ms": 0.12, "at_ms": 0.07, "prev_work": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
         "next_work": "Memcpy DtoH", "host": "aten::mm",
         "host_ops": [{"name": "aten::mm", "overlap_ms": 0.03}, {"name": "cudaStreamSynchronize", "overlap_ms": 0.005},
                      {"name": "aten::_local_scalar_dense", "overlap_ms": 0.005}]},
        {"ms": 0.01, "at_ms": 0.05, "prev_work": "triton_poi_fused_add_0",
         "next_work": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "host": "aten::mm",
         "host_ops": [{"name": "aten::mm", "overlap_ms": 0.01}]}]
    nested = events + [_x("cpu_op", "aten::item", 70, 30), _x("user_annotation", "Optimizer.step#AdamW.step", 68, 32),
                       _x("cuda_runtime", "cudaMemcpyAsync", 72, 20)]
    inner = summarize_trace(nested)["idle_gaps"][0]
    assert inner["host"] == "aten::item"  # overlapping it as much as aten::mm does: the innermost op
    assert [op["name"] for op in inner["host_ops"]] == ["aten::mm", "Optimizer.step#AdamW.step", "aten::item",
                                                        "cudaMemcpyAsync", "cudaStreamSynchronize"]
    host_only = summarize_trace([e for e in events if e["cat"] not in ("kernel", "gpu_memcpy")])  # a CPU run
    assert (host_only["idle_edges_ms"], host_only["idle_between_ms"], host_only["idle_gaps"]) == (None, None, [])
    many = [_x("kernel", f"k{i % 20}", i, 1 + i % 20) for i in range(200)]  # 20 names, 10 launches each
    top = summarize_trace(many)["top_kernels"]
    assert len(top) == 15 and top[0]["name"] == "k19" and top[0]["launches"] == 10
    assert [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    # below the 15 costliest, each kind's leaders are named too: at least 4 per kind, and on until
    # they hold 90 % of the kind's time (here 5 of 6 equal kernels: 83 %, then 100 %), at most 12
    fused = [_x("kernel", f"triton_poi_fused_{i % 20}", i, 1 + i % 20) for i in range(200)]
    mixed = fused + [_x("kernel", f"void at::native::elementwise_kernel<{i}>", 300 + i, 0.5) for i in range(6)]
    top = summarize_trace(mixed)["top_kernels"]
    others = [k for k in top if k["kind"] == "other"]
    assert len(top) == 21 and top[0]["name"] == "triton_poi_fused_19"
    assert [k["name"] for k in others] == [f"void at::native::elementwise_kernel<{i}>" for i in range(6)]
    assert [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    lopsided = fused + [_x("kernel", f"void at::native::elementwise_kernel<{i}>", 300 + i, 8.0 if i == 0 else 0.02)
                        for i in range(30)]  # one kernel holds 93 % of its kind: the 4 named suffice
    assert sum(k["kind"] == "other" for k in summarize_trace(lopsided)["top_kernels"]) == 4
    tail = summarize_trace(fused + [_x("kernel", f"void at::native::elementwise_kernel<{i}>", 300 + i, 0.1)
                                    for i in range(30)])["top_kernels"]
    assert sum(k["kind"] == "other" for k in tail) == 12  # the cap
    assert [k["ms"] for k in tail] == sorted((k["ms"] for k in tail), reverse=True)


def test_kernel_kinds():
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_f32", "kernel") == "collective"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4>", "kernel") == "other"
    assert kernel_kind("Memset (Device)", "gpu_memset") == "copy"
    # kernel names as an H100 profile showed them: flash's carry CUTLASS types, yet it is attention
    flash = ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, "
             "128, 8, 4, 4, 4, false, false, cutlass::bfloat16_t>>")
    assert kernel_kind(flash, "kernel") == "attention"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_"
                       "cga1x1x1_kernel0_0", "kernel") == "attention"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "kernel") == "matmul"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel") == "matmul"
    assert kernel_kind("triton_poi_fused__unsafe_view_mul_silu_5", "kernel") == "triton"


def test_cpu_run_writes_the_window(tmp_path):
    out = tmp_path / "run"
    assert main(["--model", "llama-tiny", "--stages", "1", "--schedule", "sync", "--steps", "4",
                 "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--profile-steps", "2:3",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "profile" / "summary_stage0.json").read_text())
    assert summary["steps"] == [2, 3] and summary["window_ms"] > 0
    assert summary["device_busy_share"] is None  # no device on CPU
    assert "aten::mm" in (out / "profile" / "summary_stage0.txt").read_text()
    names = {e.get("name") for e in json.load(gzip.open(out / "profile" / "trace_stage0.json.gz"))["traceEvents"]}
    assert "aten::mm" in names


def test_pipeline_ranks_trace_their_executor_threads(tmp_path):
    """Each stage runs on an executor thread started before the window: its operators are in."""
    out = tmp_path / "run"
    assert main(["--model", "llama-tiny", "--stages", "2", "--schedule", "2bw", "--steps", "4",
                 "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--profile-steps", "3:4",
                 "--out", str(out)]) == 0
    for stage in (0, 1):
        events = json.load(gzip.open(out / "profile" / f"trace_stage{stage}.json.gz"))["traceEvents"]
        assert sum(e.get("name") == "aten::mm" for e in events) > 0, stage
    last = json.loads((out / "profile" / "summary_stage1.json").read_text())
    # the last stage reads no microbatch's loss on its own: the step's losses come to the host
    # together at its last backward (one .tolist(), not an .item() per microbatch)
    assert last["item_calls"] == 0


def test_a_pipeline_rank_traces_its_stage_device_not_the_trainers():
    # A pipeline rank's Trainer holds its data on the CPU while its stage computes on a GPU: the
    # profiler must record that GPU's kernels (CUDA activity), which it asks the engine for.
    from types import SimpleNamespace

    import torch
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.trainer import Trainer

    cfg = RunConfig.from_dict({"train": {"profile_steps": "2:3"}})
    engine = SimpleNamespace(stage=1, replica=0, device=torch.device("cuda", 0))
    trainer = Trainer(cfg, engine, stream=None, eval_set=[], run_dir="unused", device="cpu")
    profiler = trainer._profiler()
    assert (profiler.device, profiler.who, profiler.window) == ("cuda", "stage1", (2, 3))
    trainer.engine = SimpleNamespace(stage=0)  # an engine without a device of its own: the Trainer's
    assert trainer._profiler().device == "cpu"


def test_a_cuda_window_initialises_the_tracer_before_any_graph_is_captured(monkeypatch, tmp_path):
    # --cuda-graphs captures at the first step and the window opens later: the tracer must have
    # started once before the capture (an empty profile when the profiler is made), on CUDA only.
    import contextlib

    import torch.autograd.profiler as autograd_profiler
    from asyncpp_ext.training.profiling import StepProfiler

    started = []

    @contextlib.contextmanager
    def recorder(*args, **kwargs):
        started.append(1)
        yield
    monkeypatch.setattr(autograd_profiler, "profile", recorder)
    StepProfiler((2, 3), tmp_path, "stage0", "cuda")
    assert started == [1]
    StepProfiler((2, 3), tmp_path, "stage0", "cpu")
    StepProfiler(None, tmp_path, "stage0", "cuda")
    assert started == [1]


def test_bad_window_is_one_line(tmp_path, capsys):
    assert main(["--model", "llama-tiny", "--steps", "2", "--profile-steps", "4:2",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--profile-steps" in err
    assert not (tmp_path / "r").exists()


def test_a_2bw_pipelines_window_holds_exactly_its_steps(tmp_path):
    # A 2bw stream runs ahead of its losses reaching the loop: the window's edges end segments, so
    # the trace holds steps 3 and 4 whole -- 2 steps x 2 microbatches, each two embedding lookups
    # (tokens, positions) on stage 0 and one loss on stage 1 -- rather than whatever ran while
    # their losses were on the way
    out = tmp_path / "run"
    assert main(["--model", "tiny", "--stages", "2", "--schedule", "2bw", "--microbatches", "2", "--steps", "12",
                 "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--profile-steps", "3:4",
                 "--out", str(out)]) == 0
    for stage, op, calls in ((0, "aten::embedding", 2 * 2 * 2), (1, "aten::nll_loss_forward", 2 * 2)):
        events = json.load(gzip.open(out / "profile" / f"trace_stage{stage}.json.gz"))["traceEvents"]
        assert sum(e.get("name") == op and e.get("ph") == "X" for e in events) == calls, stage
    # the rows time each step where it ended on the last stage (the stats' done_at), not where its
    # loss reached the loop with others (steps of ~2 ms, stats passed on every 10 ms): no two steps
    # end within the rows' 0.1 ms
    elapsed = [json.loads(line)["elapsed_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(b > a for a, b in zip(elapsed, elapsed[1:])), elapsed


def test_rows_time_each_step_where_it_ended_not_where_its_loss_arrived(tmp_path):
    # A pipeline's step stats reach the loop in bursts; the rows take each step's own end (the
    # engine's done_at), so tokens/s reads the steps' pace, not the burst's (millions on 2 cores)
    import time

    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.trainer import StepOutcome, Trainer

    class Bursty:  # four steps ended 50 ms apart, their losses arriving together
        def train_steps(self, stream, steps):
            t0 = time.perf_counter()
            for i in range(steps):
                yield StepOutcome(5.0 - i, done_at=t0 + 0.05 * (i + 1))

        def state_dict(self):
            return {}

    cfg = RunConfig()
    cfg.train.steps, cfg.train.eval_every, cfg.train.checkpoints, cfg.train.progress = 4, 0, False, False
    rows = Trainer(cfg, Bursty(), None, [], tmp_path, draws_plot=False).run()
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    assert gaps == pytest.approx([0.05] * 3, abs=2e-4), rows
    assert [r["tokens_per_s"] for r in rows[1:]] == pytest.approx([cfg.tokens_per_step() / 0.05] * 3, rel=1e-2)
