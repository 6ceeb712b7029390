"""Gradient-accumulation fusion (pipeline/main_grad.py, --gradient-accumulation-fusion): the weight
gradient's product adds into the float32 gradient itself -- the float32 sum of the bf16 operands'
products, which the bf16 gradient added after each microbatch only approximates; the input's
gradient and the forward are autocast's bit for bit; the gradients start from zero every step; the
compiled blocks' stacked products do it too; real 2bw == --simulate with it; bad inputs one line."""
import copy
import json

import pytest
import torch
import torch.nn as nn

from asyncpp_ext.models.registry import build_model
from asyncpp_ext.pipeline.compute_copies import ComputeCopies
from asyncpp_ext.pipeline.main_grad import MainGradLinear, MainGradProduct, linear_into_main_grad

from test_compute_copies import MODELS, _loss

M = 3


def _microbatches(seed=1, n=M, shape=(2, 5, 16), out=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randn(*shape[:-1], out, generator=g)) for _ in range(n)]


def test_the_product_adds_the_float32_sum_and_leaves_the_rest_as_autocast_computes_it():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(8, 16).bfloat16())
    main_grad = torch.zeros(8, 16)
    plain = nn.Linear(16, 8, bias=False)
    plain.weight = nn.Parameter(weight.detach().clone())
    exact = torch.zeros(8, 16, dtype=torch.float64)
    for x, c in _microbatches():
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear_into_main_grad(x1, weight, main_grad)
            want = plain(x2)
        assert torch.equal(y, want)  # the forward is autocast's product
        (y.float() * c).sum().backward()
        (want.float() * c).sum().backward()
        assert torch.equal(x1.grad, x2.grad) and x1.grad.dtype == torch.float32  # so is the input's gradient
        dy = c.bfloat16().double().reshape(-1, 8)  # the bf16 operands the products multiply
        exact += dy.t() @ x.bfloat16().double().reshape(-1, 16)
    assert weight.grad is None  # the gradient went into main_grad, not into a bf16 .grad
    fused_err = ((main_grad.double() - exact).abs().max() / exact.abs().max()).item()
    unfused_err = ((plain.weight.grad.double() - exact).abs().max() / exact.abs().max()).item()
    assert fused_err < 1e-6, fused_err  # float32 sums of exact products
    assert unfused_err > 100 * fused_err, (unfused_err, fused_err)  # each microbatch's bf16 rounding


def _step(model_copies, reference, batches, loss_fn):
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = loss_fn(model_copies.module, x, y)
            want = loss_fn(reference, x, y)
        (got / len(batches)).backward()
        model_copies.accumulate()
        (want / len(batches)).backward()


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)) for _ in range(M)]


@pytest.mark.parametrize("name", ["llama-tied-plain", "gpt", "hf-qwen2"])
def test_fused_copies_give_autocast_gradients_up_to_its_bf16_rounding_from_zero_each_step(name):
    cfg, mode = MODELS[name]
    if cfg.arch == "hf":
        pytest.importorskip("transformers", reason="needs pip install 'asyncpp_ext[hf]'")
    reference = build_model(cfg, seed=0)
    model = copy.deepcopy(reference)
    copies = ComputeCopies(model, torch.bfloat16, fuse_weight_gradients=True)
    fused = [m for m in copies.module.modules() if isinstance(m, MainGradLinear)]
    # every copied bias-free linear layer; a layer with a bias (the GPT's) keeps the bf16 gradient
    plain = ComputeCopies(copy.deepcopy(reference), torch.bfloat16)
    copied = {id(c) for c in plain.copies}
    assert len(fused) == sum(type(m) is nn.Linear and m.bias is None and id(m.weight) in copied
                             for m in plain.module.modules()) > 0
    loss_fn = _loss(mode)
    for step in range(2):
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        copies.begin_step()
        copies.refresh()
        _step(copies, reference, _batches(step), loss_fn)
    assert all(c.grad is None for c in copies.copies if any(c is m.weight for m in fused))
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        scale = q.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= 2e-2 * scale + 1e-7, n  # bf16 rounding apart
    # step 1's gradients alone: the buffer started from zero again
    fresh = ComputeCopies(copy.deepcopy(model), torch.bfloat16, fuse_weight_gradients=True)
    fresh.begin_step()
    fresh.refresh()
    _step(fresh, copy.deepcopy(reference), _batches(1), loss_fn)
    for a, b in zip(copies.main_grads, fresh.main_grads):
        assert torch.equal(a, b)


def test_compiled_blocks_add_their_stacked_products_gradients_into_the_rows_gradients():
    # against the same compiled blocks without the fusion (the stacked bf16 gradient split into the
    # rows' by accumulate): the same gradients up to that bf16 rounding, each in its own rows
    import torch._dynamo as dynamo

    from asyncpp_ext.models.compile import compile_blocks

    cfg, mode = MODELS["llama-tied-plain"]
    runs = []
    for fuse in (True, False):
        model = build_model(cfg, seed=0)
        copies = ComputeCopies(model, torch.bfloat16, fuse_weight_gradients=fuse)
        products = [m for m in copies.module.modules() if isinstance(m, MainGradProduct)]
        assert len(products) == (2 * cfg.n_layer if fuse else 0)  # q/k/v and gate/up per block
        dynamo.reset()
        compile_blocks(copies.module, backend=lambda gm, example_inputs: gm.forward)
        copies.begin_step()
        copies.refresh()
        for x, y in _batches(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _loss(mode)(copies.module, x, y).backward()
            if fuse:
                assert all(w.grad is None for w, _ in copies.stacked)  # nothing left for the bf16 path
            copies.accumulate()
        runs.append([p.grad for p in model.parameters()])
    for fused, unfused in zip(*runs):
        assert (fused - unfused).abs().max() <= 2e-2 * unfused.abs().max()


def test_the_simulator_trains_with_it_and_the_cli_refuses_it_without_bf16_copies(tmp_path, capsys):
    from asyncpp_ext.models.registry import model_config
    from asyncpp_ext.training.build import build_data, build_simulator
    from asyncpp_ext.training.cli import main
    from asyncpp_ext.training.config import RunConfig

    runs = {}
    for fused in (False, True):
        cfg = RunConfig()
        cfg.model = model_config("llama-tiny")
        cfg.pipeline.microbatches = 3
        cfg.train.dtype, cfg.train.gradient_accumulation_fusion = "bf16", fused
        stream, _ = build_data(cfg)
        engine = build_simulator(cfg)
        runs[fused] = list(engine.train_steps(stream, 4))
    assert engine.copies._own_grads is not None
    assert any(isinstance(m, MainGradLinear) for m in engine.copies.module.modules())
    assert runs[True] != runs[False]  # another sum...
    assert max(abs(a - b) / b for a, b in zip(runs[True], runs[False])) < 1e-2  # ...of the same gradients
    flags = ["--model", "llama-tiny", "--steps", "1", "--no-progress", "--gradient-accumulation-fusion"]
    for extra, words in ((["--dtype", "fp32"], "computes in float32 on cpu; use --dtype bf16"),
                         (["--dtype", "bf16", "--no-compute-copies"], "--no-compute-copies turns them off")):
        out = tmp_path / extra[-1].lstrip("-")
        assert main(flags + extra + ["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "gradient-accumulation-fusion" in err, err
        assert not out.exists()


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule,microbatches", [("2bw", 2), ("1f1b", 4)])
def test_a_pipeline_with_it_equals_its_simulation(tmp_path, schedule, microbatches):
    # 1f1b with 4 microbatches on 2 stages: backwards interleaved with forwards, each adding into
    # the gradients in the order the simulator adds them
    from asyncpp_ext.training.cli import main

    flags = ["--model", "llama-tiny", "--stages", "2", "--schedule", schedule, "--microbatches", str(microbatches),
             "--micro-batch-size", "2", "--seq-len", "16", "--steps", "4", "--threads", "1", "--dtype", "bf16",
             "--gradient-accumulation-fusion", "--eval-every", "4", "--ckpt-every", "0", "--no-progress"]
    losses = {}
    for name, extra in (("real", []), ("sim", ["--simulate"]), ("unfused", ["--no-gradient-accumulation-fusion"])):
        assert main(flags + extra + ["--out", str(tmp_path / name)]) == 0
        rows = [json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [(r["loss"], r.get("eval_loss")) for r in rows]
    assert losses["real"] == losses["sim"], losses
    assert losses["real"] != losses["unfused"]  # the fusion ran in both


@pytest.mark.cuda
def test_the_gpu_adds_the_float32_sum_in_place_and_replays_under_a_cuda_graph():
    # both ways: torch's addmm with a float32 output (where this torch has it) and cuBLAS's own
    from asyncpp_ext.optim import _kernels as K
    from asyncpp_ext.pipeline.main_grad import add_weight_gradient

    g = torch.Generator().manual_seed(0)
    for t, out, inp in ((37, 24, 40), (8192, 960, 320), (5, 3, 7)):
        for way in (add_weight_gradient, K.add_weight_gradient):
            dy = torch.randn(t, out, generator=g).bfloat16().cuda()
            x = torch.randn(t, inp, generator=g).bfloat16().cuda()
            main_grad = torch.randn(out, inp, generator=g).cuda()
            exact = main_grad.double() + dy.double().t() @ x.double()
            way(main_grad, dy, x)
            err = ((main_grad.double() - exact).abs().max() / exact.abs().max()).item()
            assert err < 1e-5, (way, t, out, inp, err)
    assert K.cublas_library().startswith("libcublas")  # torch's, found once torch used it
    # in a captured graph (torch's handle and workspace on the capture stream): each replay adds once
    once = dy.float().t() @ x.float()
    for way, (dy_in, x_in) in ((add_weight_gradient, (dy.view(1, t, out), x.view(1, t, inp))),  # leading dims
                               (K.add_weight_gradient, (dy, x))):
        main_grad = torch.zeros(out, inp, device="cuda")
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            way(main_grad, dy_in, x_in)  # warm-up outside the capture, as torch's docs ask
            main_grad.zero_()
            with torch.cuda.graph(graph, stream=stream):
                way(main_grad, dy_in, x_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        err = ((main_grad - 2 * once).abs().max() / (2 * once).abs().max()).item()
        assert err < 1e-5, (way, err)


@pytest.mark.cuda
def test_fused_copies_on_a_gpu_match_the_cpu_computation():
    cfg, mode = MODELS["llama-tied-plain"]
    results = []
    for device in ("cpu", "cuda"):
        model = build_model(cfg, seed=0).to(device)
        copies = ComputeCopies(model, torch.bfloat16, fuse_weight_gradients=True)
        copies.begin_step()
        copies.refresh()
        for x, y in _batches(5):
            with torch.autocast(device, dtype=torch.bfloat16):
                _loss(mode)(copies.module, x.to(device), y.to(device)).backward()
            copies.accumulate()
        results.append([g.cpu() for g in copies.main_grads])
    for a, b in zip(*results):  # CPU and GPU bf16 kernels round apart: bf16's bound, as on the CPU above
        assert (b - a).abs().max() <= 2e-2 * a.abs().max()


def test_a_graph_captures_warm_up_runs_add_nothing_to_the_gradients():
    # make_graphed_callables runs the computation eagerly before it captures (warm-ups) and the
    # capture first looks for what gets no gradient: those runs are no microbatch (stand-in graphs)
    from asyncpp_ext.models.graphs import GraphedCompute
    from test_cuda_graphs import FakeGraphs

    def loss(module, x, y):
        return nn.functional.mse_loss(module(x).float(), y)

    grads = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))
        copies = ComputeCopies(model, torch.bfloat16, fuse_weight_gradients=True)
        copies.begin_step()
        copies.refresh()
        run = GraphedCompute(copies.module, loss, make=FakeGraphs()) if graphed else None
        for x, y in _microbatches(shape=(3, 8), out=8):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                (run(x, y) if graphed else loss(copies.module, x, y)).backward()
            copies.accumulate()
        assert not graphed or (len(run.slots) == 1 and run.failure is None)
        grads.append([g.clone() for g in copies.main_grads])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.cuda
def test_cuda_graphs_replay_the_fused_products_into_the_gradients():
    from asyncpp_ext.models.graphs import GraphedCompute

    cfg, mode = MODELS["llama-tied-plain"]
    grads = []
    for graphed in (False, True):
        model = build_model(cfg, seed=0).cuda()
        copies = ComputeCopies(model, torch.bfloat16, fuse_weight_gradients=True)
        copies.begin_step()
        copies.refresh()
        run = GraphedCompute(copies.module, _loss(mode)) if graphed else None
        for x, y in _batches(7):
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                args = (x.cuda(), y.cuda())
                (run(*args) if graphed else _loss(mode)(copies.module, *args)).backward()
            copies.accumulate()
        assert not graphed or run.failure is None, run.failure
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):  # the same kernels, replayed (an attention backward may sum in any order)
        assert (b - a).abs().max() <= 1e-4 * a.abs().max()


def test_lost_sums_and_runs_without_copies_are_refused():
    from asyncpp_ext.pipeline.stage import StageHost

    # a step whose masters' .grad were dropped after begin_step: the products' sums would be lost
    cfg, mode = MODELS["llama-tied-plain"]
    model = build_model(cfg, seed=0)
    copies = ComputeCopies(model, torch.bfloat16, fuse_weight_gradients=True)
    copies.begin_step()
    copies.refresh()
    model.zero_grad(set_to_none=True)
    x, y = _batches(0)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loss(mode)(copies.module, x, y).backward()
    with pytest.raises(RuntimeError, match="call begin_step"):
        copies.accumulate()
    # a stage asked for the fusion without copies to fuse (float32)
    with pytest.raises(ValueError, match="this stage has none"):
        StageHost(nn.Sequential(nn.Linear(4, 4)), stage=0, stages=1, schedule="gpipe", microbatches=1,
                  optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                  loss_fn=nn.functional.mse_loss, batch_source=lambda step: None,
                  gradient_accumulation_fusion=True)


def test_the_fusion_names_the_devices_it_has_kernels_for():
    from asyncpp_ext.pipeline.main_grad import fusion_available

    assert fusion_available("cpu") is None
    assert fusion_available("meta") == "the fused product has kernels for CPU and CUDA only, not meta"


def test_the_op_never_puts_the_gradient_buffer_into_a_graph():
    # called under grad mode with inputs that require grad (a double backward, a direct call): the
    # float32 gradient stays a plain buffer, and its version counts the write
    from asyncpp_ext.pipeline.main_grad import add_weight_gradient

    main_grad = torch.zeros(8, 16)
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    before = main_grad._version
    add_weight_gradient(main_grad, dy, x)
    assert not main_grad.requires_grad and main_grad.grad_fn is None
    assert main_grad._version > before
    assert torch.allclose(main_grad, dy.detach().float().t() @ x.detach().float(), rtol=1e-5, atol=1e-6)
